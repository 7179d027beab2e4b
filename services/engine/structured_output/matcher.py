"""Structured outputs on xgrammar, the runner's half: one matcher per constrained sequence
(`GrammarState`, kept in the sampler's per-sequence state), which follows the tokens the sequence
sampled and fills its row of the token bitmask each step, and `apply_bitmask`, which masks the
logits (docs/engine-core.md "Structured outputs", steps 4-6). The sampler imports it at its first
constrained row only.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass

import torch
import xgrammar as xgr

log = logging.getLogger(__name__)


@dataclass(slots=True)
class GrammarState:
    """One sequence's matcher. It follows the sequence's output tokens lazily (`catch_up`), so a
    preempted and recomputed sequence, whose tokens do not change, needs nothing special."""

    matcher: xgr.GrammarMatcher
    stop_token_ids: list[int]
    num_accepted: int = 0
    is_broken: bool = False
    """A token was refused (cannot happen with the mask applied): only a stop token is allowed."""
    dead_end: bool = False
    """The grammar allowed no token at all (a branch that can never end, or bytes no token
    spells): only a stop token is allowed, and the runner reports the sequence so the engine
    fails its request rather than sample from nothing."""

    @classmethod
    def create(cls, compiled: xgr.CompiledGrammar) -> GrammarState:
        matcher = xgr.GrammarMatcher(compiled)
        return cls(matcher, list(compiled.tokenizer_info.stop_token_ids))

    def catch_up(self, token_ids: list[int], output_start: int = 0) -> None:
        """Accept the output tokens (token_ids[output_start:]) sampled since the last call;
        only the new ones are read, so a long answer costs nothing more per step."""
        for token in itertools.islice(token_ids, output_start + self.num_accepted, None):
            self.num_accepted += 1
            if self.is_broken or self.matcher.is_terminated():
                continue
            if not self.matcher.accept_token(token):
                log.warning("grammar refused token %d after %d tokens; ending the sequence",
                            token, self.num_accepted - 1)
                self.is_broken = True

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask [num_rows, ceil(vocab / 32)] int32: row `row` allows the next legal tokens."""
        if not (self.is_broken or self.dead_end or self.matcher.is_terminated()):
            self.matcher.fill_next_token_bitmask(bitmask, row)
            if bool(bitmask[row].any()):
                return
            log.warning("grammar allows no token after %d tokens; failing the request",
                        self.num_accepted)
            self.dead_end = True
        bitmask[row] = 0  # ended: only a stop token (ignore_eos keeps asking)
        for token in self.stop_token_ids:
            bitmask[row, token // 32] |= _bit(token % 32)


def _bit(offset: int) -> int:
    """The int32 value with only bit `offset` set (bit 31 is the sign bit)."""
    return (1 << offset) - (1 << 32 if offset == 31 else 0)


def apply_bitmask(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """logits [num_rows, vocab] (in place): in each listed row, every token its grammar forbids
    gets -inf; other rows are untouched. xgrammar's kernel masks (C++ on CPU, Triton on CUDA);
    the bitmask is filled on the CPU and copied once to the logits' device."""
    num_rows, vocab = logits.shape
    bitmask = xgr.allocate_token_bitmask(num_rows, vocab)  # [num_rows, ceil(vocab / 32)], all -1
    for row, state in zip(rows, states):
        state.fill(bitmask, row)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=rows)
