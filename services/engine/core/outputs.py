"""The data that crosses between the engine scheduler and the model runner, once per step.

`scheduler.schedule() -> SchedulerOutput`, `runner.execute(SchedulerOutput) -> RunnerOutput`,
`scheduler.update(SchedulerOutput, RunnerOutput) -> list[Sequence]` (the sequences that changed,
which the engine core then detokenizes; docs/engine-core.md "One step, three calls"). Plain
frozen data: ints and lists, no tensors, no Sequence objects, so the runner can live in other
processes (tensor and pipeline parallelism) without changing the contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ScheduledSeq:
    """One sequence's share of a step (vLLM's one token rule: computed catches up with known)."""

    seq_id: int
    token_ids: list[int]
    """The tokens fed this step: all_tokens[start_pos : start_pos + len(token_ids)]."""
    start_pos: int
    """num_computed_tokens before this step: the position of token_ids[0]. 0 = fresh (or
    recomputed after preemption): the runner resets its copy of the sequence's tokens."""
    block_ids: list[int]
    """The sequence's whole block table after this step's allocation."""
    is_sampling: bool
    """True when this step reaches the end of the known tokens, so a token is sampled."""
    prompt_len: int
    """Number of prompt tokens (penalties treat the rest as output; min_tokens counts them)."""
    sampling_params: SamplingParams
    """Frozen; the runner keys its per-sequence sampling state (seeded generator) on seq_id."""
    seed_offset: int = 0
    """Child index for n > 1: child i draws from the generator seeded with (seed, i)."""
    want_prompt_logprobs: bool = False
    """This chunk's prompt tokens need logprobs (sampling_params.prompt_logprobs is set)."""
    prefix_token_ids: list[int] | None = None
    """Set only on the first step of a (re)started sequence whose start_pos > 0 (a prefix-cache
    hit, or an n > 1 child sharing its sibling's prompt blocks): all_tokens[:start_pos], which the
    runner never saw. The runner resets its token copy to prefix_token_ids + token_ids whenever
    this is set (and, as before, whenever start_pos == 0). None on every other step."""
    num_spec_tokens: int = 0
    """Speculative decoding: KV slots reserved after token_ids (a decode only) for up to this many
    draft tokens, which the runner proposes, feeds and verifies in this step's forward."""
    lora_request: LoRARequest | None = None
    """The LoRA adapter this sequence's tokens run with (None: the base model). A step holds at
    most max_loras distinct adapters (the scheduler's rule); the runner loads them as needed."""
    num_resumed: int = 0
    """Output tokens the sequence resumed from (Sequence.num_resumed)."""


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq]
    """Decodes first, then prefill chunks, in the order the runner flattens them."""
    finished_seq_ids: list[int] = field(default_factory=list)
    """Sequences finished or aborted since the last step: the runner drops their state."""
    num_preempted: int = 0
    """Sequences preempted while building this step (for metrics)."""

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The logprob of one chosen token and the top-N alternatives at its position."""

    token_id: int
    logprob: float
    rank: int
    """1-based rank of token_id among the vocabulary at this position."""
    top: list[tuple[int, float]] = field(default_factory=list)
    """[(token_id, logprob)] sorted best first, N = the requested logprobs count."""


@dataclass(frozen=True, slots=True)
class RunnerOutput:
    sampled_token_ids: dict[int, int]
    """seq_id -> the token sampled this step (only sequences with is_sampling)."""
    logprobs: dict[int, TokenLogprob] = field(default_factory=dict)
    """seq_id -> logprob of the sampled token (only when sampling_params.logprobs is set)."""
    prompt_logprobs: dict[int, list[TokenLogprob | None]] = field(default_factory=dict)
    """seq_id -> this chunk's part of the prompt's logprobs. The logits at position p predict
    prompt token p + 1; token b belongs to the next chunk, so the runner keeps the last
    position's logprobs until then: a chunk [a, b) yields entries for prompt tokens max(a, 1) ..
    min(b, prompt_len) - 1, preceded by None when a == 0 (token 0 has no prefix). Concatenated
    over the chunks: [None, lp(1), ..., lp(prompt_len - 1)]. The scheduler never serves a request
    that wants prompt logprobs from the prefix cache (nothing would compute those positions)."""
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    """seq_id -> the draft tokens accepted this step; they come before sampled_token_ids[seq_id]
    (which is the target's own token after them). Absent: nothing accepted."""
    num_draft_tokens: dict[int, int] = field(default_factory=dict)
    """seq_id -> drafts proposed and verified this step (only sequences that had any)."""
    grammar_dead_ends: list[int] = field(default_factory=list)
    """Sequences whose grammar allowed no token this step (their sampled token is a stop token,
    not a draw from nothing): the engine fails their requests."""

    def merged(self, other: RunnerOutput | None) -> RunnerOutput:
        """This output with another's sequences added (the speculative sequences' results)."""
        if other is None:
            return self
        return RunnerOutput({**self.sampled_token_ids, **other.sampled_token_ids},
                            {**self.logprobs, **other.logprobs},
                            {**self.prompt_logprobs, **other.prompt_logprobs},
                            {**self.spec_token_ids, **other.spec_token_ids},
                            {**self.num_draft_tokens, **other.num_draft_tokens},
                            self.grammar_dead_ends + other.grammar_dead_ends)
