"""The NATS adapter of a backend instance: shoal.infer.<id> answered by the backend's OpenAI HTTP
API, in the same replies our engine sends (InferChunk seq 0 with the prompt's token ids, then
deltas, then InferEnd with usage or InferError), so the gateway routes, limits, counts and
traces a backend's requests as any engine's.

Prompts are rendered here as the engine renders them (its InputProcessor over the model's
tokenizer) and sent to `/v1/completions` as token ids, streamed, with vLLM's extras (sampling
knobs, structured outputs, `return_token_ids`, usage with `cached_tokens`); a server that
ignores an extra still answers (a delta without token ids is counted by tokenizing its text).
A client that goes away cancels the request's task, which closes its HTTP stream: the backend
aborts the request. The request's `traceparent` goes on to the backend's HTTP request.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from collections.abc import Awaitable
from typing import Any

import aiohttp
from opentelemetry import trace
from prometheus_client.parser import text_string_to_metric_families

from nats.aio.msg import Msg

from shoal.services.backends.embed import embed_reply, embedding_body, score_body, score_reply
from shoal.services.engine import InputProcessor, Replies, StreamIntake
from shoal.shared.bus.codec import decode, encode
from shoal.shared.errors import InvalidRequest, ShoalError, Unavailable
from shoal.shared.genai import response_attributes
from shoal.shared.schemas.infer import (
    ChoiceDelta, DetokenizeReply, DetokenizeRequest, EmbedReply, EmbedRequest, EngineLoad,
    GenerateRequest, InferRequestEnvelope, SamplingOptions, ScoreReply, ScoreRequest,
    TokenizeReply, TokenizeRequest, TokenLogprobWire, TopLogprob, Usage
)
from shoal.shared.telemetry import inject_headers

log = logging.getLogger(__name__)
LOAD_GAUGES = {"vllm:num_requests_running": "num_running",
               "vllm:num_requests_waiting": "num_waiting",
               "vllm:kv_cache_usage_perc": "kv_cache_usage",
               "vllm:gpu_cache_usage_perc": "kv_cache_usage"}
"""vLLM's gauges read from its /metrics into the load the gateway routes by."""


def completion_body(req: GenerateRequest, served_name: str, token_ids: list[int]) -> dict[str, Any]:
    """The /v1/completions body of a request (vLLM's names; a default value is left out)."""
    s: SamplingOptions = req.sampling
    body: dict[str, Any] = {
        "model": served_name, "prompt": token_ids, "stream": True,
        "stream_options": {"include_usage": True}, "return_token_ids": True,
        "n": s.n, "temperature": s.temperature, "top_p": s.top_p, "max_tokens": s.max_tokens,
        "skip_special_tokens": s.skip_special_tokens}
    optional = {"top_k": s.top_k or None, "min_p": s.min_p or None,
                "presence_penalty": s.presence_penalty or None,
                "frequency_penalty": s.frequency_penalty or None,
                "repetition_penalty": None if s.repetition_penalty == 1.0 else s.repetition_penalty,
                "seed": s.seed, "stop": s.stop or None, "stop_token_ids": s.stop_token_ids or None,
                "ignore_eos": s.ignore_eos or None, "min_tokens": s.min_tokens or None,
                "include_stop_str_in_output": s.include_stop_str_in_output or None,
                "prompt_logprobs": s.prompt_logprobs,
                "logit_bias": ({str(k): v for k, v in s.logit_bias.items()}
                               if s.logit_bias else None)}
    body.update({k: v for k, v in optional.items() if v is not None})
    if s.logprobs is not None:
        body["logprobs"] = s.logprobs
        body["return_tokens_as_token_ids"] = True  # "token_id:N": ids, not ambiguous text
    if s.structured_outputs is not None:
        body["structured_outputs"] = s.structured_outputs.model_dump(exclude_none=True,
                                                                     by_alias=True)
    return body


def token_id_of(token: str) -> int:
    """vLLM's "token_id:123" (return_tokens_as_token_ids) -> 123; -1 when the server sent text."""
    head, _, tail = token.partition(":")
    return int(tail) if head == "token_id" and tail.isdigit() else -1


def error_from_body(status: int, text: str) -> ShoalError:
    """The backend's refusal in our error kinds, its message, param and code (a string one:
    vLLM's may be the status) kept (OpenAI's shape or vLLM's {"object": "error", ...})."""
    try:
        data = json.loads(text)
    except ValueError:
        data = {}
    err = data.get("error", data) if isinstance(data, dict) else {}
    err = err if isinstance(err, dict) else {"message": str(err)}
    message = str(err.get("message") or text[:500] or f"backend answered {status}")
    param = err.get("param") if isinstance(err.get("param"), str) else None
    code = err.get("code") if isinstance(err.get("code"), str) else None
    if 400 <= status < 500:
        return ShoalError.from_dict({"message": message, "param": param, "code": code},
                                    400 if status == 422 else status)
    return Unavailable(f"backend error {status}: {message}")


@dataclass(kw_only=True)
class BackendHandlers(StreamIntake):
    base_url: str
    served_name: str
    tokenizer: Any
    max_model_len: int
    max_num_seqs: int = 256
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    embedding: bool = False
    """The backend serves an embedding model or a cross-encoder: EmbedRequests go to its
    /v1/embeddings and ScoreRequests to its /v1/score (each in a task among the lookups, which
    a drain waits for) and generation is refused, as our embedding engine refuses it."""
    session: aiohttp.ClientSession | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=lambda: {
        "prompt_tokens": 0, "generation_tokens": 0, "prefix_cache_hits": 0,
        "prefix_cache_queries": 0})
    tokenizing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))

    async def start(self) -> None:
        # One tokenizer, used by one thread at a time: /tokenize and /detokenize queue with
        # the prompts (our engine gives its lookups a tokenizer of their own instead)
        self.lookups = self.tokenizing
        self.inputs = InputProcessor(tokenizer=self.tokenizer, max_model_len=self.max_model_len,
                                     chat_template=self.chat_template)
        self.inputs.longest_token_bytes()  # a scan of the vocabulary: at start, not per request
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None,
                                                                           sock_connect=10))
        await super().start()

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def fail_all(self) -> None:
        """The backend is gone: every stream ends now, with an error (not at its timeout)."""
        for task in list(self.tasks.values()):
            task.cancel(msg="backend exited")

    # ------------------------------------------------------------------ requests
    async def on_request(self, msg: Msg) -> None:
        if not self.embedding:
            await super().on_request(msg)
            return
        try:
            request = decode(msg.data, InferRequestEnvelope).request
        except InvalidRequest as exc:
            await self.bus.respond_error(msg, exc)
            return
        if isinstance(request, GenerateRequest):
            if msg.reply:
                await Replies(self.bus.nc, msg.reply, request.request_id).error(InvalidRequest(
                    f"model {self.model_name} is an embedding model: it serves /v1/embeddings, "
                    "not generation", param="model", code="wrong_model_type"), 400)
            return
        if isinstance(request, EmbedRequest):
            answer = self.embed(request)
        elif isinstance(request, ScoreRequest):  # the backend says whether the model scores
            answer = self.score(request)
        else:
            await super().on_request(msg)  # /tokenize, /detokenize
            return
        task = asyncio.create_task(self._answer_pooled(answer, msg))
        self.lookup_tasks.add(task)
        task.add_done_callback(self.lookup_tasks.discard)

    async def _answer_pooled(self, answer: Awaitable[EmbedReply | ScoreReply], msg: Msg) -> None:
        try:
            reply = await answer
        except ShoalError as exc:
            await self.bus.respond_error(msg, exc)
            return
        except (aiohttp.ClientError, ValueError, TypeError, AttributeError) as exc:
            await self.bus.respond_error(msg, Unavailable(
                f"backend error: {type(exc).__name__}: {exc}"))
            return
        await msg.respond(encode(reply))

    async def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        """One pooling call to the backend: its JSON answer, or its error in our words."""
        assert self.session is not None
        async with self.session.post(f"{self.base_url}{path}", json=body,
                                     headers=inject_headers()) as response:
            text = await response.text()
            if response.status != 200:
                raise error_from_body(response.status, text)
        return json.loads(text)

    async def embed(self, req: EmbedRequest) -> EmbedReply:
        reply = embed_reply(await self._post_json("/v1/embeddings",
                                                  embedding_body(req, self.served_name)))
        self.counters["prompt_tokens"] += reply.prompt_tokens
        return reply

    async def score(self, req: ScoreRequest) -> ScoreReply:
        reply = score_reply(await self._post_json("/v1/score", score_body(req, self.served_name)),
                            len(req.text_1))
        self.counters["prompt_tokens"] += reply.prompt_tokens
        return reply

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        ids = self.prompt_token_ids(req)
        return TokenizeReply(tokens=ids, count=len(ids), max_model_len=self.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        assert self.inputs is not None, "start() sets the input processor"
        return DetokenizeReply(prompt=self.inputs.detokenize(req.tokens, len(self.tokenizer)))

    async def serve(self, req: GenerateRequest, replies: Replies, span: trace.Span) -> None:
        arrival = time.monotonic()
        try:
            token_ids = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, self.prompt_token_ids, req)
            if len(token_ids) >= self.max_model_len:
                raise InvalidRequest(
                    f"This model's maximum context length is {self.max_model_len} tokens; the "
                    f"prompt has {len(token_ids)}", param="messages" if req.messages else "prompt")
            if req.resume is not None:  # its output cannot be seeded from the middle
                raise Unavailable("a backend's instance cannot resume a stream",
                                  code="resume_unsupported")
            parser = self.check_tool_call_parser(req, self.tool_call_parser)
            await replies.chunk(choices=[], prompt_token_ids=token_ids, tool_call_parser=parser,
                                reasoning_parser=self.reasoning_parser_for(
                                    req, self.reasoning_parser))
            usage, reasons, ttft = None, {}, None
            async for chunk in self._stream(completion_body(req, self.served_name, token_ids)):
                if chunk.get("usage"):
                    usage = chunk["usage"]
                deltas = [self._delta(c, req.sampling.logprobs or 0)
                          for c in chunk.get("choices") or []]
                if not deltas:
                    continue
                ttft = ttft if ttft is not None else time.monotonic() - arrival
                reasons.update({d.index: d.finish_reason for d in deltas if d.finish_reason})
                await replies.chunk(choices=deltas)
            final = self._usage(usage, len(token_ids))
            span.set_attributes(response_attributes(final, [reasons[i] for i in sorted(reasons)]))
            await replies.end(instance_id=self.instance_id, usage=final, finish_reasons=reasons,
                              ttft_s=ttft)
        except asyncio.CancelledError as exc:
            gone = "backend exited" in str(exc.args[0] if exc.args else "")
            err = (Unavailable("the backend process exited mid-request") if gone
                   else ShoalError("request aborted", code="aborted"))
            await replies.error(err, 503 if gone else 499)
            raise
        except ShoalError as exc:
            await replies.error(exc, exc.http_status)
        except (aiohttp.ClientError, ValueError) as exc:  # the backend died or spoke nonsense
            await replies.error(Unavailable(f"backend error: {type(exc).__name__}: {exc}"), 503)

    async def _stream(self, body: dict[str, Any]) -> Any:
        """The backend's SSE events as dicts; an error answer or event raises it."""
        assert self.session is not None
        async with self.session.post(f"{self.base_url}/v1/completions", json=body,
                                     headers=inject_headers()) as response:
            if response.status != 200:
                raise error_from_body(response.status, await response.text())
            async for raw in response.content:
                line = raw.decode(errors="replace").strip()
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    err = event["error"]
                    raise error_from_body(int(err.get("code") or 500)
                                          if str(err.get("code", "")).isdigit() else 500,
                                          json.dumps(event))
                yield event

    def _delta(self, c: dict[str, Any], top_n: int = 0) -> ChoiceDelta:
        text = c.get("text") or ""
        ids = c.get("token_ids")
        if ids is None:  # a server without vLLM's return_token_ids: count the text's tokens
            ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        return ChoiceDelta(index=int(c.get("index", 0)), text=text, token_ids=list(ids),
                           logprobs=self._logprobs(c.get("logprobs"), top_n),
                           finish_reason=c.get("finish_reason"),
                           stop_reason=c.get("stop_reason"))

    def _logprobs(self, lp: dict[str, Any] | None, top_n: int) -> list[TokenLogprobWire] | None:
        """vLLM's completion logprobs as ours: its top_logprobs hold the sampled token beside the
        top `top_n` (all of them at logprobs 0), so the `top_n` most likely are kept, best
        first, as our engine sends them."""
        if not lp or not lp.get("tokens"):
            return None
        items = []
        for token, value, top in zip(lp["tokens"], lp.get("token_logprobs") or [],
                                     lp.get("top_logprobs") or [{}] * len(lp["tokens"]),
                                     strict=False):
            tid = token_id_of(token)
            best = sorted((top or {}).items(), key=lambda kv: -kv[1])[:top_n]
            tops = [TopLogprob(token_id=token_id_of(t), token=self._text(t), logprob=v)
                    for t, v in best]
            items.append(TokenLogprobWire(token_id=tid, token=self._text(token),
                                          logprob=value if value is not None else 0.0, top=tops))
        return items

    def _text(self, token: str) -> str:
        tid = token_id_of(token)
        return self.tokenizer.decode([tid]) if tid >= 0 else token

    def _usage(self, usage: dict[str, Any] | None, prompt_tokens: int) -> Usage:
        usage = usage or {}
        details = usage.get("prompt_tokens_details") or {}
        final = Usage(prompt_tokens=int(usage.get("prompt_tokens") or prompt_tokens),
                      completion_tokens=int(usage.get("completion_tokens") or 0),
                      cached_tokens=int(details.get("cached_tokens") or 0))
        self.counters["prompt_tokens"] += final.prompt_tokens
        self.counters["generation_tokens"] += final.completion_tokens
        self.counters["prefix_cache_queries"] += final.prompt_tokens
        self.counters["prefix_cache_hits"] += final.cached_tokens
        return final

    # ------------------------------------------------------------------ load
    async def scrape(self) -> None:
        """The backend's own gauges (vLLM's running / waiting / KV use), when it has them."""
        assert self.session is not None
        try:
            async with self.session.get(f"{self.base_url}/metrics",
                                        timeout=aiohttp.ClientTimeout(total=2)) as response:
                if response.status != 200:
                    return
                text = await response.text()
        except (aiohttp.ClientError, TimeoutError):
            return
        found: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            key = LOAD_GAUGES.get(family.name)
            if key is not None:
                found[key] = sum(s.value for s in family.samples)
        self.gauges = found

    def load(self) -> EngineLoad:
        in_flight = sum(1 for t in self.tasks.values() if not t.done())
        if self.embedding:
            in_flight += len(self.lookup_tasks)
        g = self.gauges
        return EngineLoad(
            instance_id=self.instance_id, model_name=self.model_name,
            num_running=int(g.get("num_running", in_flight)),
            num_waiting=int(g.get("num_waiting", 0)),
            kv_cache_usage=min(1.0, max(0.0, g.get("kv_cache_usage", 0.0))),
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            draining=self.draining, **self.counters)
