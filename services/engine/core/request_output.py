"""What users get back: RequestOutput / CompletionOutput with vLLM's names and meanings, and
the output kind (cumulative, delta for streams, final only for the offline LLM).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shoal.services.engine.core.outputs import TokenLogprob
from shoal.services.engine.core.spec_decode_stats import SpecDecodeStats


class RequestOutputKind(enum.Enum):
    CUMULATIVE = "cumulative"
    """Every output carries everything generated so far."""
    DELTA = "delta"
    """Every output carries only what is new since the previous one (streaming)."""
    FINAL_ONLY = "final_only"
    """One output, when the request finishes."""


@dataclass(slots=True)
class CompletionOutput:
    index: int
    """Child index (n > 1)."""
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    """Sum of the sampled tokens' logprobs (None unless logprobs were requested)."""
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None
    """"stop" | "length" | "abort" | None while running."""
    stop_reason: int | str | None = None
    """The stop string or stop token id that ended the text; None for EOS or length."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Wall-clock times (time.time()) for TTFT, queue time and end-to-end latency."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[TokenLogprob | None] | None
    """[None, lp(token 1), ...] when prompt_logprobs was requested (sent once in delta mode)."""
    outputs: list[CompletionOutput]
    """In delta mode, only the children with something new."""
    finished: bool
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    error: Exception | None = None
    """Set on the final output of a request the engine failed (its grammar allowed no token):
    the streams raise it, LLM.generate too."""

    @property
    def num_generated_tokens(self) -> int:
        return sum(len(o.token_ids) for o in self.outputs)

    def merge(self, later: RequestOutput) -> None:
        """Fold a later delta of the same request into this one, as if the two steps had been
        one: the stream's consumer fell behind, so it gets one message instead of several."""
        children = {c.index: c for c in self.outputs}
        for new in later.outputs:
            old = children.get(new.index)
            if old is None:
                children[new.index] = new
                self.outputs.append(new)
                continue
            old.text += new.text
            old.token_ids = old.token_ids + new.token_ids
            if new.logprobs is not None:
                old.logprobs = (old.logprobs or []) + new.logprobs
            old.cumulative_logprob = new.cumulative_logprob
            old.finish_reason, old.stop_reason = new.finish_reason, new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics


@dataclass(slots=True)
class EngineStats:
    """A snapshot for /metrics (vLLM names) and the load published to the router."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    """Fraction of KV blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
    num_preemptions: int
    prefix_cache_queries: int
    """Cumulative, in tokens (vllm:prefix_cache_queries)."""
    prefix_cache_hits: int
    prompt_tokens: int
    """Cumulative prompt tokens of requests that produced their first token."""
    generation_tokens: int
    """Cumulative sampled tokens."""
    spec_decode: SpecDecodeStats | None = None
    """Speculative decoding's counters (vllm:spec_decode_*) and acceptance rate; None when the
    engine does not speculate."""
    running_loras: tuple[str, ...] = ()
    """Names of the LoRA adapters of the running sequences (vllm:lora_requests_info)."""
    waiting_loras: tuple[str, ...] = ()
    """Names of the LoRA adapters of the waiting sequences."""
