"""How one step's RunnerOutput changes a scheduled sequence (the update half of a step,
`Scheduler.update`): its computed tokens advance, newly full blocks go to the prefix cache, the
sampled token (and the accepted drafts of a verified step) are appended, and the stop rules say
whether it ends. The scheduler applies an ending (`Scheduler._finish`, which also changes its
queues), so every change to a sequence stays in the scheduler's modules and the block manager.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.services.engine.core.block_manager import BlockManager
from shoal.services.engine.core.outputs import RunnerOutput, ScheduledSeq
from shoal.services.engine.core.sequence import Sequence, SequenceStatus
from shoal.services.engine.core.spec_decode_stats import SpecDecodeStats

Finish = tuple[SequenceStatus, int | None]
"""How a sequence ends: its status and stop reason (the stop token id, or None)."""


@dataclass(frozen=True, slots=True)
class StopRule:
    eos_token_ids: frozenset[int]
    max_model_len: int

    def check(self, seq: Sequence) -> Finish | None:
        """Whether seq's last token ends it: EOS (unless ignore_eos) or a stop token once
        min_tokens tokens exist, then max_tokens and max_model_len. Stop strings are the
        detokenizer's (Scheduler.stop_at_string)."""
        token, params = seq.token_ids[-1], seq.params
        if seq.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED, None
            if token in params.stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED, token
        if seq.num_output_tokens >= seq.max_tokens or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH, None
        return None


def apply_step(seq: Sequence, s: ScheduledSeq, run: RunnerOutput, blocks: BlockManager,
               stops: StopRule, spec_stats: SpecDecodeStats, now: float) -> Finish | None:
    """Apply seq's share of a step (s) and its results (run); returns how it ends, if it does."""
    if s.num_spec_tokens:
        return _apply_verified(seq, s, run, blocks, stops, spec_stats, now)
    seq.num_computed_tokens += len(s.token_ids)
    if s.want_prompt_logprobs:
        seq.prompt_logprobs.extend(run.prompt_logprobs.get(s.seq_id, []))
    blocks.cache_full_blocks(seq)
    if not s.is_sampling:
        return None
    seq.append_token(run.sampled_token_ids[s.seq_id], run.logprobs.get(s.seq_id))
    if seq.first_token_time is None:
        seq.first_token_time = now
    return stops.check(seq)


def _apply_verified(seq: Sequence, s: ScheduledSeq, run: RunnerOutput, blocks: BlockManager,
                    stops: StopRule, spec_stats: SpecDecodeStats, now: float) -> Finish | None:
    """A verified step: the fed token and the accepted drafts now have KV; the accepted
    drafts and the target's next token are appended one by one (a stop ends it there); the
    blocks reserved for rejected drafts go back to the pool."""
    accepted = run.spec_token_ids.get(s.seq_id, [])
    spec_stats.observe(run.num_draft_tokens.get(s.seq_id, 0), len(accepted))
    seq.num_computed_tokens += len(s.token_ids) + len(accepted)
    seq.token_ids.extend(accepted)  # register the full blocks over the accepted tokens ...
    blocks.cache_full_blocks(seq)
    if accepted:
        del seq.token_ids[-len(accepted):]  # ... then append them as sampled tokens
    finish = None
    for token in [*accepted, run.sampled_token_ids[s.seq_id]]:
        seq.append_token(token)
        finish = stops.check(seq)
        if finish is not None:
            break
    if seq.first_token_time is None:
        seq.first_token_time = now
    if finish is None:
        blocks.trim(seq)
    return finish
