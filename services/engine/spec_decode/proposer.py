"""Proposers behind one interface, and the factory that builds the configured one."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from shoal.services.engine.core.outputs import ScheduledSeq
from shoal.services.engine.runner.sampler import SeqState
from shoal.services.engine.spec_decode.ngram import NgramProposer
from shoal.shared.schemas.speculative import SpeculativeConfig

if TYPE_CHECKING:
    from shoal.services.engine.runner.model_runner import ModelRunner


class Proposer(Protocol):
    def propose(self, seqs: list[ScheduledSeq], states: list[SeqState]) -> list[list[int]]:
        """Per decode seq (num_spec_tokens > 0; its state's token_ids end with the token fed this
        step): up to num_spec_tokens drafts."""
        ...


class NgramBatch:
    """The n-gram proposer over a batch: each sequence on its own token copy."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        assert spec.prompt_lookup_min is not None and spec.prompt_lookup_max is not None
        self.ngram = NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)

    def propose(self, seqs: list[ScheduledSeq], states: list[SeqState]) -> list[list[int]]:
        return [self.ngram.propose(state.token_ids, s.num_spec_tokens)
                for s, state in zip(seqs, states, strict=True)]


def make_proposer(spec: SpeculativeConfig, runner: ModelRunner) -> Proposer:
    if spec.method == "ngram":
        return NgramBatch(spec)
    from shoal.services.engine.spec_decode.draft import make_draft_proposer

    return make_draft_proposer(spec, runner)
