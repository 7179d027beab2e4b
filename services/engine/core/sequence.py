"""Sequence: one generated continuation of a request (n > 1 gives n of them), as the scheduler
sees it: its tokens, how many have KV in the cache, its block table and its status.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from shoal.services.engine.core.outputs import TokenLogprob
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self not in (SequenceStatus.WAITING, SequenceStatus.RUNNING)

    @property
    def finish_reason(self) -> str | None:
        """OpenAI's finish_reason: "stop" | "length" | "abort", None while unfinished."""
        return self.value if self.is_finished else None


@dataclass(slots=True, eq=False)
class Sequence:
    seq_id: int
    request_id: str
    token_ids: list[int]
    """Prompt followed by every sampled token."""
    prompt_len: int
    params: SamplingParams
    index: int = 0
    """Child index for n > 1 (also the runner's seed_offset)."""
    arrival_time: float = 0.0
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    """Tokens whose KV is in the cache (computed, or reused from the prefix cache)."""
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache when this sequence was first scheduled."""
    block_ids: list[int] = field(default_factory=list)
    """The block table; only BlockManager writes it."""
    block_hashes: list[int] = field(default_factory=list)
    """Chained hashes of the full blocks of token_ids known so far (BlockManager fills it)."""
    num_registered_blocks: int = 0
    """Leading blocks of block_ids already offered to the prefix cache (BlockManager)."""
    max_tokens: int = 0
    """Output token limit (params.max_tokens, or what max_model_len leaves)."""
    stop_reason: int | str | None = None
    """The stop token id or stop string that finished the sequence (None for EOS / length)."""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    is_restarted: bool = True
    """The next scheduled step is the first since (re)starting: the runner must reset."""
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    lora_request: LoRARequest | None = None
    """The LoRA adapter it runs with (None: the base model)."""
    num_resumed: int = 0
    """Output tokens it resumed from (a failover): the runner advances its seeded generator
    past them, so a seeded request samples as if it had never moved."""

    @property
    def hash_root(self) -> int | None:
        """Where its block hashes chain from: the adapter's root, None for the base model."""
        return self.lora_request.hash_root if self.lora_request is not None else None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Child 0 of a request asking for prompt logprobs, until it has all of them."""
        return (self.params.prompt_logprobs is not None and self.index == 0
                and len(self.prompt_logprobs) < self.prompt_len)

    def append_token(self, token_id: int, logprob: TokenLogprob | None = None) -> None:
        self.token_ids.append(token_id)
        if logprob is not None:
            self.logprobs.append(logprob)
            self.cumulative_logprob += logprob.logprob
