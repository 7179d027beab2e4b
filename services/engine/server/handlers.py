"""The NATS adapter of one engine: shoal.infer.<id>, aborts, load (the intake and load it
shares with the embedding engine's adapter are intake.py's).

It only translates: a GenerateRequest's prompt becomes token ids through the engine's
InputProcessor (input_processor.py: chat templates, tokenization, the prompt policy), the request
an AsyncEngine stream, each RequestOutput delta an InferChunk (seq 0 = accepted, then 1, 2, ...),
the end an InferEnd with usage, an error an InferError with its HTTP status. Engine compute stays
on the engine's own thread.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from opentelemetry.trace import Span

from shoal.services.engine.frontend.async_engine import AsyncEngine
from shoal.services.engine.frontend.output_stream import RequestStream
from shoal.services.engine.frontend.tokenizer import load_tokenizer
from shoal.services.engine.core.outputs import TokenLogprob
from shoal.services.engine.core.request_output import RequestOutput
from shoal.services.engine.core.request_state import Resumed
from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams
from shoal.services.engine.server.intake import Replies, StreamIntake
from shoal.services.engine.server.metrics import EngineMetrics
from shoal.services.engine.server.tracing import record_finished
from shoal.shared.errors import InvalidRequest, NotFound, ShoalError
from shoal.shared.schemas.infer import (
    ChoiceDelta, DetokenizeReply, DetokenizeRequest, EngineLoad,
    GenerateRequest,
    TokenizeReply,
    TokenizeRequest, TokenLogprobWire, TopLogprob, Usage
)

log = logging.getLogger(__name__)
INLINE_PROMPT_BYTES = 8192
"""A prompt (or chat) up to this many bytes is tokenized on the event loop: well under a
millisecond, less than the thread hop it saves."""


def prompt_bytes(req: GenerateRequest) -> int:
    """The text a request's prompt carries (prompt, messages' contents, tools), in bytes."""
    size = len((req.prompt or "").encode())
    size += sum(len((m.content or "").encode()) for m in req.messages or [])
    return size + (len(repr(req.tools).encode()) if req.tools else 0)


@dataclass(kw_only=True)
class EngineHandlers(StreamIntake):
    engine: AsyncEngine
    tokenizer: Any = None
    metrics: EngineMetrics | None = None
    tokenizing: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize"))
    """Prompts are tokenized here, off the event loop: a 4 MiB prompt takes seconds, during which
    the loop must keep publishing loads (or gateways count the engine dead and fail its streams)
    and serving every other stream. One thread: the handlers' tokenizer is used by one at a time."""
    lookup_inputs: InputProcessor | None = None
    """/tokenize and /detokenize's own input processor and tokenizer, used on the `lookups`
    thread (intake.py): not ahead of the chats' prompts in `tokenizing`."""
    loras: dict[str, LoRARequest] = field(default_factory=dict)
    """The LoRA adapters this engine serves, by name (the model's lora_modules); each is loaded
    and checked by the engine at its first request."""
    lora_source: Callable[[], Awaitable[list[Any]]] | None = None
    """The model's lora_modules now (the registry's): read when a request names an adapter this
    engine does not know, so one loaded at runtime (/v1/load_lora_adapter) is served at once."""
    _lora_ids: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    _tokenizing_jobs: int = 0
    """Prompts handed to `tokenizing` and not back yet."""
    chat_template_tokens: int = 0
    """What the chat template adds to a one-message chat (published with the load: gateways
    estimate a chat's prompt with it when they reserve a key's tokens)."""

    async def start(self) -> None:
        # A tokenizer of our own: the engine thread detokenizes with its copy meanwhile.
        self.tokenizer = load_tokenizer(self.engine.core.model_dir)
        core = self.engine.core
        self.inputs = InputProcessor(tokenizer=self.tokenizer, max_model_len=core.max_model_len,
                                     chat_template=core.config.chat_template)
        self.inputs.longest_token_bytes()  # a scan of the vocabulary: at start, not per request
        self.lookup_inputs = InputProcessor(
            tokenizer=load_tokenizer(core.model_dir), max_model_len=core.max_model_len,
            chat_template=core.config.chat_template, max_token_bytes=self.inputs.max_token_bytes)
        try:
            self.chat_template_tokens = len(
                self.inputs.chat([{"role": "user", "content": ""}]).token_ids)
        except InvalidRequest:  # a template that needs more than one user turn
            self.chat_template_tokens = 0
        await super().start()

    async def serve(self, req: GenerateRequest, replies: Replies, span: Span) -> None:
        outputs: RequestStream | None = None
        try:
            token_ids = await self.tokenize_prompt(req)
            params = SamplingParams(**req.sampling.model_dump())
            parser = self.tool_call_parser(req)
            lora = await self.lora_request(req.lora_name)
            resume = (Resumed(tuple(req.resume.token_ids), req.resume.text)
                      if req.resume is not None else None)
            outputs = self.engine.open(req.request_id, token_ids, params, time.time(),
                                       prompt=req.prompt,  # the engine's one check: 400 here
                                       lora_request=lora, resume=resume)
            await replies.chunk(choices=[], prompt_token_ids=token_ids,
                                tool_call_parser=parser,
                                reasoning_parser=self.reasoning_parser_for(
                                    req, self.engine.core.config.reasoning_parser))
            last: RequestOutput | None = None
            finish_reasons: dict[int, str] = {}
            child_tokens: dict[int, int] = {}
            async for out in outputs:
                last = out
                replies.cached_tokens = out.num_cached_tokens
                for c in out.outputs:
                    child_tokens[c.index] = child_tokens.get(c.index, 0) + len(c.token_ids)
                finish_reasons.update({c.index: c.finish_reason for c in out.outputs
                                       if c.finish_reason})
                await replies.chunk(choices=[self.choice(c) for c in out.outputs],
                                    prompt_logprobs=self.prompt_logprobs(out))
            assert last is not None
            m = last.metrics
            usage = Usage(prompt_tokens=len(token_ids),
                          completion_tokens=sum(child_tokens.values()),
                          cached_tokens=last.num_cached_tokens)
            record_finished(span, m, usage, [finish_reasons[i] for i in sorted(finish_reasons)])
            if self.metrics is not None:
                self.metrics.on_finished(m, req.sampling, len(token_ids), child_tokens,
                                         finish_reasons)
            await replies.end(
                instance_id=self.instance_id, usage=usage, finish_reasons=finish_reasons,
                ttft_s=(m.first_token_time - m.arrival_time) if m.first_token_time else None,
                queue_s=((m.first_scheduled_time - m.arrival_time) if m.first_scheduled_time
                         else None),
            )
        except asyncio.CancelledError:
            await replies.error(ShoalError("request aborted", code="aborted"), 499)
            raise
        except ShoalError as exc:
            await replies.error(exc, exc.http_status)
        except Exception as exc:  # noqa: BLE001 - the client gets an error, never a hang
            log.exception("generate %s failed", req.request_id)
            await replies.error(ShoalError(f"engine error: {type(exc).__name__}"), 500)
        finally:
            if outputs is not None:
                outputs.close()  # aborts the request in the engine unless it finished

    # ------------------------------------------------------------------ tokens
    async def tokenize_prompt(self, req: GenerateRequest) -> list[int]:
        """The prompt's token ids: a short prompt on the loop itself when the `tokenizing`
        thread is idle (a hop to that thread cost ~1.5 ms of the first token, issue 31 item 6;
        idle, so the tokenizer is never used by two threads at once), a long one there."""
        if self._tokenizing_jobs == 0 and prompt_bytes(req) <= INLINE_PROMPT_BYTES:
            return self.prompt_token_ids(req)
        job = asyncio.get_running_loop().run_in_executor(self.tokenizing, self.prompt_token_ids,
                                                         req)
        self._tokenizing_jobs += 1
        job.add_done_callback(self._tokenized)
        return await asyncio.shield(job)  # cancelled here, the job stays counted until it ends

    def _tokenized(self, _job: object) -> None:
        self._tokenizing_jobs -= 1

    async def lora_request(self, name: str | None) -> LoRARequest | None:
        """The adapter a request names (vLLM's 404 for one this engine does not serve). An
        unknown name rereads the model's lora_modules first (the gateway sends only names it
        resolved to an adapter of this model, so made-up names do not reach here)."""
        if name is None:
            return None
        if name not in self.loras and self.lora_source is not None:
            self.set_loras(await self.lora_source())
        lora = self.loras.get(name)
        if lora is None:
            raise NotFound(f"The lora adapter '{name}' cannot be found.", param="model")
        return lora

    def set_loras(self, modules: list[Any]) -> None:
        """The adapters to serve (LoRAModule-like: name, path, base_model_name): one kept
        under the same name and path keeps its id (the engine's caches key on it)."""
        loras = {}
        for m in modules:
            known = self.loras.get(m.name)
            loras[m.name] = (known if known is not None and known.lora_path == m.path else
                             LoRARequest(m.name, next(self._lora_ids), m.path, m.base_model_name))
        self.loras = loras

    def tool_call_parser(self, req: GenerateRequest) -> str | None:
        return self.check_tool_call_parser(req, self.engine.core.config.tool_call_parser)

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        ids = self.prompt_token_ids(req, self.lookup_inputs)
        return TokenizeReply(tokens=ids, count=len(ids),
                             max_model_len=self.engine.core.max_model_len)

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        inputs = self.lookup_inputs or self.inputs
        assert inputs is not None, "start() sets the input processors"
        return DetokenizeReply(prompt=inputs.detokenize(req.tokens, self.engine.core.vocab_bound))

    def choice(self, c: Any) -> ChoiceDelta:
        logprobs = [self.logprob(lp) for lp in c.logprobs] if c.logprobs is not None else None
        return ChoiceDelta(index=c.index, text=c.text, token_ids=list(c.token_ids),
                           logprobs=logprobs, finish_reason=c.finish_reason,
                           stop_reason=c.stop_reason)

    def logprob(self, lp: TokenLogprob) -> TokenLogprobWire:
        decode_one = self.tokenizer.decode
        top = [TopLogprob(token_id=t, token=decode_one([t]), logprob=v) for t, v in lp.top]
        return TokenLogprobWire(token_id=lp.token_id, token=decode_one([lp.token_id]),
                                logprob=lp.logprob, top=top)

    def prompt_logprobs(self, out: RequestOutput) -> list[TokenLogprobWire | None] | None:
        if not out.prompt_logprobs:
            return None
        return [self.logprob(lp) if lp is not None else None for lp in out.prompt_logprobs]

    # ------------------------------------------------------------------ load
    def load(self) -> EngineLoad:
        s = self.engine.stats()
        cfg = self.engine.core.config
        return EngineLoad(
            instance_id=self.instance_id, model_name=self.model_name, num_running=s.num_running,
            num_waiting=s.num_waiting, kv_cache_usage=s.kv_cache_usage,
            max_num_seqs=cfg.max_num_seqs,
            max_model_len=self.engine.core.max_model_len, num_preemptions=s.num_preemptions,
            prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
            prompt_tokens=s.prompt_tokens, generation_tokens=s.generation_tokens,
            draining=self.draining, chat_template_tokens=self.chat_template_tokens,
        )
