"""The NATS adapter of an embedding engine: shoal.infer.<id> answers EmbedRequest (one reply
each) and tokenize; its intake and load messages are a generation engine's (intake.py), so the
gateway's instance table and router treat both kinds alike.

Kept apart from handlers.py (generation): no streams, no sampling, no chat templates. Like it,
it only translates: the embedding engine's InputProcessor turns the inputs into token ids.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from dataclasses import dataclass, field

from nats.aio.msg import Msg

from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine
from shoal.services.engine.server.intake import Intake
from shoal.shared.bus.codec import decode, encode
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.schemas.common import ErrorBody
from shoal.shared.schemas.infer import (
    EmbedReply, EmbedRequest, EngineLoad, GenerateRequest, InferError, InferReplyEnvelope,
    InferRequestEnvelope, ScoreReply, ScoreRequest, TokenizeReply, TokenizeRequest
)

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class EmbedHandlers(Intake):
    engine: AsyncEmbeddingEngine
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def wait_in_flight(self, timeout: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout)

    async def on_request(self, msg: Msg) -> None:
        # each request on its own task, so a batch can gather while another is computed
        task = asyncio.create_task(self._answer(msg))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _answer(self, msg: Msg) -> None:
        try:
            request = decode(msg.data, InferRequestEnvelope).request
            if isinstance(request, GenerateRequest):  # answered as a stream expects
                if msg.reply:
                    await self.bus.nc.publish(msg.reply, encode(InferReplyEnvelope(reply=InferError(
                        request_id=request.request_id, seq=0, status=400, error=ErrorBody(
                            **self.not_generative().to_dict())))))
                return
            if isinstance(request, EmbedRequest):
                reply: EmbedReply | ScoreReply | TokenizeReply = await self.embed(request)
            elif isinstance(request, ScoreRequest):
                reply = await self.score(request)
            elif isinstance(request, TokenizeRequest):
                reply = self.tokenize(request)
            else:
                raise self.not_generative()
        except ShoalError as exc:
            await self.bus.respond_error(msg, exc)
            return
        except Exception as exc:  # noqa: BLE001 - the client gets an error, never a hang
            log.exception("embedding request failed")
            await self.bus.respond_error(msg, ShoalError(f"engine error: {type(exc).__name__}"))
            return
        await msg.respond(encode(reply))

    async def embed(self, req: EmbedRequest) -> EmbedReply:
        if self.engine.engine.score_head is not None:
            raise InvalidRequest(f"model {self.model_name} is a cross-encoder: it serves "
                                 "/v1/score and /v1/rerank, not /v1/embeddings", param="model",
                                 code="wrong_model_type")
        ids = await asyncio.to_thread(self.engine.engine.inputs.embedding_inputs, req.texts,
                                      req.token_ids, req.truncate_prompt_tokens)
        vectors = await self.engine.embed(ids, req.dimensions)
        data = vectors.contiguous().numpy().astype("<f4").tobytes()
        return EmbedReply(data=base64.b64encode(data).decode(), num_inputs=vectors.shape[0],
                          dimensions=vectors.shape[1], prompt_tokens=sum(len(x) for x in ids))

    async def score(self, req: ScoreRequest) -> ScoreReply:
        if self.engine.engine.score_head is None:
            raise InvalidRequest(f"model {self.model_name} is an embedding model, not a "
                                 "cross-encoder: it serves /v1/embeddings, not /v1/score or "
                                 "/v1/rerank", param="model", code="wrong_model_type")
        if len(req.text_1) != len(req.text_2):
            raise InvalidRequest("text_1 and text_2 must pair up", param="text_2")
        pairs = await asyncio.to_thread(self.engine.engine.inputs.pair_inputs, req.text_1,
                                        req.text_2, req.truncate_prompt_tokens)
        scores = await self.engine.score(pairs)
        return ScoreReply(scores=scores.tolist(), prompt_tokens=sum(len(p[0]) for p in pairs))

    def not_generative(self) -> InvalidRequest:
        serves = ("/v1/score and /v1/rerank" if self.engine.engine.score_head is not None
                  else "/v1/embeddings")
        return InvalidRequest(f"model {self.model_name} is an embedding model: it serves "
                              f"{serves}, not generation", param="model",
                              code="wrong_model_type")

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        if req.prompt is None:
            raise InvalidRequest("an embedding model tokenizes a prompt, not messages",
                                 param="prompt")
        core = self.engine.engine
        ids = core.inputs.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return TokenizeReply(tokens=ids, count=len(ids), max_model_len=core.max_model_len)

    def load(self) -> EngineLoad:
        s = self.engine.stats
        return EngineLoad(instance_id=self.instance_id, model_name=self.model_name,
                          num_running=s.num_running, num_waiting=s.num_waiting,
                          kv_cache_usage=0.0, max_num_seqs=self.engine.engine.config.max_num_seqs,
                          max_model_len=self.engine.engine.max_model_len,
                          prompt_tokens=s.prompt_tokens, draining=self.draining)
