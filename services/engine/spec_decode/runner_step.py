"""SpecStep: what the model runner does for speculative decoding in a step. Before the forward it
asks the proposer for drafts for the sequences the scheduler reserved slots for; after it, it
verifies them on their rows of logits and records the accepted drafts in the sequences' token
copies (the rejected ones were never added: their KV slots are simply overwritten later).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.services.engine.core.outputs import RunnerOutput, ScheduledSeq
from shoal.services.engine.runner.sampler import SeqState
from shoal.services.engine.spec_decode.proposer import Proposer, make_proposer
from shoal.services.engine.spec_decode.verify import verify
from shoal.shared.schemas.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from shoal.services.engine.runner.model_runner import ModelRunner


class SpecStep:
    def __init__(self, proposer: Proposer, eos_token_ids: frozenset[int]) -> None:
        self.proposer = proposer
        self.eos_token_ids = eos_token_ids

    @classmethod
    def build(cls, spec: SpeculativeConfig | None, runner: ModelRunner) -> SpecStep | None:
        return None if spec is None else cls(make_proposer(spec, runner), runner.eos_token_ids)

    def propose(self, scheduled: list[ScheduledSeq], states: list[SeqState]
                ) -> list[list[int]] | None:
        """Per scheduled seq its drafts ([] for most); None when no seq has slots reserved."""
        wanted = [i for i, s in enumerate(scheduled) if s.num_spec_tokens > 0]
        if not wanted:
            return None
        drafts: list[list[int]] = [[] for _ in scheduled]
        proposed = self.proposer.propose([scheduled[i] for i in wanted],
                                         [states[i] for i in wanted])
        for i, d in zip(wanted, proposed, strict=True):
            drafts[i] = d[:scheduled[i].num_spec_tokens]
        return drafts

    def verify(self, scheduled: list[ScheduledSeq], states: list[SeqState],
               drafts: list[list[int]], sample_rows: list[int | None], logits: torch.Tensor
               ) -> RunnerOutput:
        """Verify each drafted sequence on its len(drafts) + 1 logits rows (modified in place)."""
        sampled: dict[int, int] = {}
        accepted: dict[int, list[int]] = {}
        counts: dict[int, int] = {}
        for s, state, draft, row in zip(scheduled, states, drafts, sample_rows, strict=True):
            if not draft:
                continue
            assert row is not None
            ok, token = verify(logits[row:row + len(draft) + 1], state, draft, self.eos_token_ids)
            state.token_ids.extend(ok)  # fed and accepted: part of the sequence from now on
            sampled[s.seq_id] = token
            counts[s.seq_id] = len(draft)
            if ok:
                accepted[s.seq_id] = ok
        return RunnerOutput(sampled, spec_token_ids=accepted, num_draft_tokens=counts)
