"""Scheduler: continuous batching, and the only owner of sequence state. Each step it gives every
sequence min(num_tokens - num_computed_tokens, budget) tokens (vLLM's one token rule: no prefill
or decode phase), running sequences first, then waiting ones, and preempts the newest running
sequence by recompute when the KV pool runs out (`schedule`); then it applies the runner's
results (`update`, per sequence in step_update.py) and ends sequences (`_finish`). The requests
it refuses are request_checks.py's.
"""

from __future__ import annotations

import time
from collections import deque

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.block_manager import BlockManager
from shoal.services.engine.core.block_pool import Block
from shoal.services.engine.core.outputs import RunnerOutput, ScheduledSeq, SchedulerOutput
from shoal.services.engine.core.request_checks import RequestLimits
from shoal.services.engine.core.sequence import Sequence, SequenceStatus
from shoal.services.engine.core.spec_decode_stats import SpecDecodeStats
from shoal.services.engine.core.step_update import StopRule, apply_step
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest

_BLOCKED = object()
"""_prompt_source's answer for an n > 1 child whose first sibling is still computing the prompt."""


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_manager = BlockManager(num_kv_blocks, config.block_size,
                                          config.enable_prefix_caching)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.requests: dict[str, list[Sequence]] = {}
        self.seqs: dict[int, Sequence] = {}
        self.num_preemptions = 0
        self._finished_seq_ids: list[int] = []
        """Finished or aborted since the last step: the runner drops their state."""
        self._finished_in_schedule: list[Sequence] = []
        """Finished while scheduling (their KV can never fit): reported by the next update()."""
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.spec_stats = SpecDecodeStats(self.num_spec_tokens)
        self.limits = RequestLimits(max_model_len, num_kv_blocks, config.block_size,
                                    config.max_num_batched_tokens, config.enable_chunked_prefill)
        self.stops = StopRule(eos_token_ids, max_model_len)
        self.max_loras = config.max_loras if config.enable_lora else 0
        """Distinct LoRA adapters the running sequences may hold (0: LoRA off)."""

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """Work left, including finished sequences the runner has not been told about."""
        return bool(self.has_requests() or self._finished_seq_ids)

    def has_requests(self) -> bool:
        """Sequences to run or to report: has_unfinished() less the finished sequences whose
        runner state a step has yet to drop (any later step drops it, with its own batch)."""
        return bool(self.waiting or self.running or self._finished_in_schedule)

    def check_request(self, prompt_len: int, params: SamplingParams) -> None:
        """Refuse (InvalidRequest) a request that could never run; never truncate it."""
        self.limits.check(prompt_len, params)

    def add(self, seqs: list[Sequence], params: SamplingParams | None = None) -> None:
        """Queue a request's sequences (n > 1 children share one prompt). The request passed
        check_request at the engine's edge (EngineCore.process); it is not checked again.
        params: replaces theirs (the grammar gate's, carrying the compiled grammar)."""
        first = seqs[0]
        if first.request_id in self.requests:
            raise InvalidRequest(f"request id {first.request_id!r} is already running",
                                 param="request_id")
        self.requests[first.request_id] = seqs
        for seq in seqs:
            if params is not None:
                seq.params = params
            seq.max_tokens = seq.params.max_tokens or self.max_model_len - seq.prompt_len
            self.seqs[seq.seq_id] = seq
            self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSeq] = []
        num_preempted = 0
        i = 0
        spec_on = self.num_spec_tokens > 0 and (self.spec_disable_by_batch_size is None or
                                                len(self.running) < self.spec_disable_by_batch_size)
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            num_spec = self._num_spec(seq, budget) if spec_on and num_new == 1 else 0
            if num_spec and self.block_manager.allocate_slots(seq, 1 + num_spec):
                scheduled.append(self._scheduled(seq, 1, num_spec))
                budget -= 1 + num_spec
                i += 1
                continue
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()  # the newest running sequence
                if victim is seq and not self.running:
                    # Alone with the whole pool and still short: it can never fit.
                    self._finish(victim, SequenceStatus.FINISHED_LENGTH)
                    self._finished_in_schedule.append(victim)
                else:
                    self._preempt(victim)
                    num_preempted += 1
                if victim is seq:
                    break
            else:
                scheduled.append(self._scheduled(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break
        if num_preempted == 0:
            budget = self._schedule_waiting(budget, scheduled)
        finished, self._finished_seq_ids = self._finished_seq_ids, []
        return SchedulerOutput(scheduled, finished, num_preempted)

    def update(self, out: SchedulerOutput, run: RunnerOutput) -> list[Sequence]:
        """Apply a step's results: advance computed tokens, cache newly full blocks, append the
        sampled tokens and finish what stopped. Returns the sequences that changed."""
        changed, self._finished_in_schedule = self._finished_in_schedule, []
        now = time.time()
        any_finished = False
        for s in out.scheduled:
            seq = self.seqs.get(s.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            finish = apply_step(seq, s, run, self.block_manager, self.stops, self.spec_stats,
                                now)
            if finish is not None:
                self._finish(seq, *finish)
                any_finished = True
            if s.is_sampling or s.num_spec_tokens:
                changed.append(seq)
        if any_finished:
            self.running = [seq for seq in self.running if not seq.is_finished]
        return changed

    def _num_spec(self, seq: Sequence, budget: int) -> int:
        """Draft slots for a decoding seq: the configured number, within its max_tokens,
        max_model_len and the step's budget. Requests with structured outputs or logprobs run
        without speculation (docs/engine-core.md)."""
        p = seq.params
        if p.structured_outputs is not None or p.logprobs is not None:
            return 0
        return max(0, min(self.num_spec_tokens, seq.max_tokens - seq.num_output_tokens - 1,
                          self.max_model_len - seq.num_tokens, budget - 1))

    def finish(self, seq: Sequence, status: SequenceStatus,
               stop_reason: int | str | None = None) -> None:
        """Finish a sequence from outside, wherever it is (also one the scheduler never held:
        a request aborted while its grammar compiled)."""
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._finish(seq, status, stop_reason)

    def stop_at_string(self, seq: Sequence, stop: str,
                       num_output_tokens: int | None = None) -> None:
        """The detokenizer found a stop string in seq's text: it ends there, keeping its first
        num_output_tokens output tokens (None: all; the tokens after the one that completed the
        stop are dropped, as if never sampled). A sequence that finished by length in the same
        step ends by the stop string instead: it wins."""
        if num_output_tokens is not None:
            del seq.token_ids[seq.prompt_len + num_output_tokens:]
        if seq.is_finished:
            seq.status, seq.stop_reason = SequenceStatus.FINISHED_STOPPED, stop
        else:
            self.finish(seq, SequenceStatus.FINISHED_STOPPED, stop)

    def abort(self, request_id: str) -> list[Sequence]:
        """Abort every unfinished sequence of a request, wherever it is; frees its blocks."""
        seqs = self.requests.get(request_id, [])
        for seq in list(seqs):
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seqs

    def _schedule_waiting(self, budget: int, scheduled: list[ScheduledSeq]) -> int:
        skipped: list[Sequence] = []
        bs = self.block_manager.block_size
        loras = ({s.lora_request for s in self.running if s.lora_request is not None}
                 if self.max_loras else set())
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            source = self._prompt_source(seq)
            lora = seq.lora_request
            if source is _BLOCKED or (lora is not None and lora not in loras
                                      and len(loras) >= self.max_loras):
                skipped.append(self.waiting.popleft())  # (its adapter would exceed max_loras:
                continue  # it waits until a running adapter's last sequence ends)
            computed: list[Block] | None = None
            if isinstance(source, Sequence):
                computed = self.block_manager.shared_prefix(seq, source)
            elif self.block_manager.enable_prefix_caching and not seq.wants_prompt_logprobs:
                computed = self.block_manager.find_cached_prefix(seq)
            num_new = seq.num_tokens - len(computed or []) * bs
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.time()
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            if lora is not None:
                loras.add(lora)
            scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _prompt_source(self, seq: Sequence) -> Sequence | object | None:
        """For an n > 1 child: the first sibling once its prompt KV is computed (share its
        blocks), _BLOCKED until then, None when the sibling is gone (use the prefix cache)."""
        if seq.index == 0 or seq.num_output_tokens > 0:
            return None
        first = self.requests[seq.request_id][0]
        if first.is_finished:
            return None
        if first.status is SequenceStatus.RUNNING and first.num_computed_tokens >= seq.prompt_len:
            return first
        return _BLOCKED

    def _scheduled(self, seq: Sequence, num_new: int, num_spec: int = 0) -> ScheduledSeq:
        start = seq.num_computed_tokens
        prefix = None
        if seq.is_restarted:
            seq.is_restarted = False
            if start > 0:
                prefix = seq.token_ids[:start]
        return ScheduledSeq(
            seq_id=seq.seq_id, token_ids=seq.token_ids[start:start + num_new], start_pos=start,
            block_ids=list(seq.block_ids), is_sampling=start + num_new == seq.num_tokens,
            prompt_len=seq.prompt_len, sampling_params=seq.params, seed_offset=seq.index,
            want_prompt_logprobs=seq.wants_prompt_logprobs and start < seq.prompt_len,
            prefix_token_ids=prefix, num_spec_tokens=num_spec, lora_request=seq.lora_request,
            num_resumed=seq.num_resumed)

    def _preempt(self, seq: Sequence) -> None:
        """Recompute later: free its blocks and put it at the front of the queue."""
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.is_restarted = True
        if seq.wants_prompt_logprobs:
            seq.prompt_logprobs.clear()  # partial: the recompute produces them again
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, status: SequenceStatus,
                stop_reason: int | str | None = None) -> None:
        seq.status = status
        seq.stop_reason = stop_reason
        seq.finish_time = time.time()
        self.block_manager.free(seq)
        if self.seqs.pop(seq.seq_id, None) is not None:  # the runner may have state for it
            self._finished_seq_ids.append(seq.seq_id)
        group = self.requests.get(seq.request_id)
        if group is not None and all(s.is_finished for s in group):
            del self.requests[seq.request_id]
