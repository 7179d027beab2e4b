"""Counters of speculative decoding with vLLM's meanings (vllm:spec_decode_*), torch-free: the
scheduler keeps them as it applies verified steps."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpecDecodeStats:
    num_spec_tokens: int = 0
    """The configured num_speculative_tokens (the length of accepted_per_pos)."""
    num_drafts: int = 0
    """Sequence-steps that verified at least one draft token."""
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    """accepted_per_pos[i]: drafts accepted at position i (the i+1-th draft of a step)."""

    def observe(self, num_draft: int, num_accepted: int) -> None:
        if num_draft <= 0:
            return
        if len(self.accepted_per_pos) < self.num_spec_tokens:
            self.accepted_per_pos.extend([0] * (self.num_spec_tokens - len(self.accepted_per_pos)))
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verifying step: 1 + accepted drafts per draft (vLLM's figure)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_spec_tokens, self.num_drafts, self.num_draft_tokens,
                               self.num_accepted_tokens, list(self.accepted_per_pos))
