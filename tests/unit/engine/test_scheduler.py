"""Scheduler: token budget, max_num_seqs, decodes first, chunked prefill, preemption by
recompute, abort in every state, length limits, stop conditions, prefix hits and n > 1."""

from __future__ import annotations

import itertools

import pytest

from tests.unit.engine.engine_helpers import EOS, FakeRunner, assert_scheduler_whole
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.outputs import RunnerOutput, SchedulerOutput
from shoal.services.engine.sampling_params import SamplingParams
from shoal.services.engine.core.scheduler import Scheduler
from shoal.services.engine.core.sequence import Sequence, SequenceStatus
from shoal.shared.errors import InvalidRequest

_ids = itertools.count()


def make(num_blocks: int = 64, block_size: int = 4, max_model_len: int = 256,
         **cfg) -> tuple[Scheduler, FakeRunner]:
    config = EngineConfig(model="fake", block_size=block_size, **cfg)
    runner = FakeRunner(num_blocks, block_size, max_model_len)
    return Scheduler(config, num_blocks, max_model_len, runner.eos_token_ids), runner


def add(sched: Scheduler, prompt: list[int], params: SamplingParams | None = None,
        request_id: str | None = None) -> list[Sequence]:
    params = params or SamplingParams(temperature=0, max_tokens=8)
    rid = request_id or f"req-{next(_ids)}"
    seqs = [Sequence(next(_ids), rid, list(prompt), len(prompt), params, index=i)
            for i in range(params.n)]
    sched.check_request(len(prompt), params)  # the engine's edge checks, then the scheduler adds
    sched.add(seqs)
    return seqs


def step(sched: Scheduler, runner: FakeRunner) -> SchedulerOutput:
    out = sched.schedule()
    assert out.num_batched_tokens <= sched.max_num_batched_tokens
    assert len(out.scheduled) <= sched.max_num_seqs
    run = runner.execute(out) if out.scheduled or out.finished_seq_ids else RunnerOutput({})
    sched.update(out, run)
    assert_scheduler_whole(sched)
    return out


def run_all(sched: Scheduler, runner: FakeRunner, max_steps: int = 1000) -> list[SchedulerOutput]:
    outs = []
    while sched.has_unfinished():
        outs.append(step(sched, runner))
        assert len(outs) < max_steps, "no progress"
    return outs


def prompt(n: int, start: int = 1) -> list[int]:
    return list(range(start, start + n))


def test_token_budget_chunks_the_last_prefill_that_does_not_fit():
    sched, runner = make(max_num_batched_tokens=16)
    seqs = [add(sched, prompt(10, 100 * i + 1))[0] for i in range(3)]
    out = step(sched, runner)
    assert [(s.seq_id, len(s.token_ids)) for s in out.scheduled] == [(seqs[0].seq_id, 10),
                                                                     (seqs[1].seq_id, 6)]
    assert [s.is_sampling for s in out.scheduled] == [True, False]
    out = step(sched, runner)  # decode of 0, rest of 1's prompt, then a chunk of 2's
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in out.scheduled] == [
        (seqs[0].seq_id, 10, 1), (seqs[1].seq_id, 6, 4), (seqs[2].seq_id, 0, 10)]
    run_all(sched, runner)
    assert all(s.num_output_tokens == 8 for s in seqs)


def test_max_num_seqs_caps_the_running_set():
    sched, runner = make(max_num_seqs=2)
    seqs = [add(sched, prompt(5, 10 * i + 1))[0] for i in range(5)]
    for out in run_all(sched, runner):
        assert len(out.scheduled) <= 2
    assert all(s.status is SequenceStatus.FINISHED_LENGTH for s in seqs)


def test_decodes_are_scheduled_before_new_prefills():
    sched, runner = make(max_num_batched_tokens=8)
    first = add(sched, prompt(4))[0]
    step(sched, runner)
    late = add(sched, prompt(30, 50))[0]
    out = step(sched, runner)
    assert [s.seq_id for s in out.scheduled] == [first.seq_id, late.seq_id]
    assert len(out.scheduled[0].token_ids) == 1 and len(out.scheduled[1].token_ids) == 7


def test_chunked_prefill_feeds_the_prompt_in_budget_sized_chunks():
    sched, runner = make(max_num_batched_tokens=16)
    seq = add(sched, prompt(40), SamplingParams(temperature=0, max_tokens=3))[0]
    outs = run_all(sched, runner)
    chunks = [(o.scheduled[0].start_pos, len(o.scheduled[0].token_ids), o.scheduled[0].is_sampling)
              for o in outs if o.scheduled]
    assert chunks == [(0, 16, False), (16, 16, False), (32, 8, True), (40, 1, True), (41, 1, True)]
    assert seq.num_output_tokens == 3


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    sched, runner = make(max_num_batched_tokens=32, enable_chunked_prefill=False)
    a = add(sched, prompt(20), SamplingParams(max_tokens=4))[0]
    b = add(sched, prompt(20, 100), SamplingParams(max_tokens=4))[0]
    out = step(sched, runner)
    assert [s.seq_id for s in out.scheduled] == [a.seq_id]
    with pytest.raises(InvalidRequest):
        add(sched, prompt(30), SamplingParams(max_tokens=4))  # could never be scheduled
    run_all(sched, runner)
    assert b.num_output_tokens == 4


def reference_tokens(prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    sched, runner = make(num_blocks=256)
    seqs = [add(sched, p, params)[0] for p in prompts]
    run_all(sched, runner)
    return [s.output_token_ids for s in seqs]


def test_preemption_by_recompute_under_a_tiny_pool_gives_the_same_tokens():
    params = SamplingParams(temperature=0, max_tokens=20)
    prompts = [prompt(9, 100 * i + 1) for i in range(6)]
    sched, runner = make(num_blocks=14, enable_prefix_caching=False)
    seqs = [add(sched, p, params)[0] for p in prompts]
    outs = run_all(sched, runner)
    assert sched.num_preemptions > 0 and sum(o.num_preempted for o in outs) == sched.num_preemptions
    assert [s.output_token_ids for s in seqs] == reference_tokens(prompts, params)
    assert runner.dropped == {s.seq_id for s in seqs}  # every finished one was reported
    assert sched.block_manager.num_free_blocks == 14


def test_preemption_takes_the_newest_running_sequence_and_requeues_it_first():
    sched, runner = make(num_blocks=8, enable_prefix_caching=False)
    old = add(sched, prompt(8), SamplingParams(max_tokens=20))[0]
    new = add(sched, prompt(8, 50), SamplingParams(max_tokens=20))[0]
    step(sched, runner)  # both prefilled: 2 blocks each, 4 free
    while sched.num_preemptions == 0:
        out = step(sched, runner)
    assert new.status is SequenceStatus.WAITING and sched.waiting[0] is new
    assert new.block_ids == [] and new.num_computed_tokens == 0
    assert old.status is SequenceStatus.RUNNING
    assert [s.seq_id for s in out.scheduled] == [old.seq_id]
    out = None
    while out is None or new.seq_id not in [s.seq_id for s in out.scheduled]:
        out = step(sched, runner)
    resumed = next(s for s in out.scheduled if s.seq_id == new.seq_id)
    # A whole recompute of prompt + generated tokens, which samples the next token.
    assert resumed.start_pos == 0 and resumed.is_sampling
    assert resumed.token_ids == new.token_ids[:-1]
    assert len(resumed.token_ids) > new.prompt_len


def test_preemption_with_prefix_caching_resumes_from_the_cache():
    params = SamplingParams(temperature=0, max_tokens=20)
    prompts = [prompt(9, 100 * i + 1) for i in range(6)]
    sched, runner = make(num_blocks=14)
    seqs = [add(sched, p, params)[0] for p in prompts]
    run_all(sched, runner)
    assert sched.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == reference_tokens(prompts, params)


def test_a_sequence_that_can_never_fit_ends_with_length():
    sched, runner = make(num_blocks=2, max_model_len=64)
    seq = add(sched, prompt(3), SamplingParams(max_tokens=None))[0]
    run_all(sched, runner)
    assert seq.status is SequenceStatus.FINISHED_LENGTH and seq.num_tokens == 8 + 1


@pytest.mark.parametrize("where", ["waiting", "mid_prefill", "decoding"])
def test_abort_frees_everything_in_every_state(where):
    sched, runner = make(max_num_batched_tokens=8)
    other = add(sched, prompt(4, 200), SamplingParams(max_tokens=12))[0]
    seq = add(sched, prompt(20), SamplingParams(max_tokens=12))[0]
    if where != "waiting":
        step(sched, runner)  # other: 4 tokens, seq: a 4-token chunk
        assert seq.status is SequenceStatus.RUNNING and seq.num_computed_tokens == 4
    if where == "decoding":
        while seq.num_output_tokens == 0:
            step(sched, runner)
    sched.abort(seq.request_id)
    assert seq.status is SequenceStatus.FINISHED_ABORTED and seq.block_ids == []
    assert seq not in sched.running and seq not in sched.waiting
    assert_scheduler_whole(sched)
    out = step(sched, runner)
    assert seq.seq_id in out.finished_seq_ids
    assert seq.seq_id not in [s.seq_id for s in out.scheduled]
    run_all(sched, runner)
    assert other.status is SequenceStatus.FINISHED_LENGTH
    assert sched.block_manager.num_free_blocks == 64 and sched.requests == {}


def test_too_long_requests_are_refused_not_truncated():
    sched, _ = make(max_model_len=32)
    with pytest.raises(InvalidRequest) as err:
        add(sched, prompt(30), SamplingParams(max_tokens=3))
    assert err.value.param == "max_tokens" and "32" in err.value.message
    with pytest.raises(InvalidRequest) as err:
        add(sched, prompt(32), SamplingParams(max_tokens=None))
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest):
        add(sched, [], SamplingParams())
    assert not sched.has_unfinished() and sched.requests == {}


def test_max_tokens_none_runs_to_max_model_len():
    sched, runner = make(max_model_len=32)
    seq = add(sched, prompt(29), SamplingParams(max_tokens=None))[0]
    run_all(sched, runner)
    assert seq.num_tokens == 32 and seq.status is SequenceStatus.FINISHED_LENGTH


def scripted(tokens: list[int]):
    """A runner 'model' that emits tokens[i] as the i-th output token."""
    def next_token(context: list[int], seed_offset: int) -> int:
        return tokens[len(context) - 5]  # all prompts below have 5 tokens
    return next_token


@pytest.mark.parametrize("params,expected_len,status,stop_reason", [
    (SamplingParams(max_tokens=10), 3, SequenceStatus.FINISHED_STOPPED, None),
    (SamplingParams(max_tokens=10, ignore_eos=True), 10, SequenceStatus.FINISHED_LENGTH, None),
    (SamplingParams(max_tokens=10, stop_token_ids=[7]), 2, SequenceStatus.FINISHED_STOPPED, 7),
    (SamplingParams(max_tokens=10, min_tokens=4), 5, SequenceStatus.FINISHED_STOPPED, None),
    (SamplingParams(max_tokens=2), 2, SequenceStatus.FINISHED_LENGTH, None),
])
def test_stop_conditions(params, expected_len, status, stop_reason):
    sched, runner = make()
    runner.next_token = scripted([5, 7, EOS, 8, EOS, 9, 9, 9, 9, 9])
    seq = add(sched, prompt(5), params)[0]
    run_all(sched, runner)
    assert seq.num_output_tokens == expected_len
    assert seq.status is status and seq.stop_reason == stop_reason


def test_a_repeated_prompt_hits_the_prefix_cache_and_tells_the_runner():
    sched, runner = make()
    p = prompt(18)
    first = add(sched, p)[0]
    run_all(sched, runner)
    second = add(sched, p)[0]
    out = step(sched, runner)
    s = out.scheduled[0]
    assert s.start_pos == 16 and s.prefix_token_ids == p[:16] and s.token_ids == p[16:]
    assert second.num_cached_tokens == 16
    run_all(sched, runner)
    assert second.output_token_ids == first.output_token_ids
    bm = sched.block_manager
    assert bm.num_prefix_queries == 36 and bm.num_prefix_hits == 16


def test_prompt_logprobs_requests_never_read_the_prefix_cache():
    sched, runner = make(max_num_batched_tokens=8)
    p = prompt(18)
    add(sched, p)
    run_all(sched, runner)
    seq = add(sched, p, SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    outs = run_all(sched, runner)
    assert outs[0].scheduled[0].start_pos == 0 and outs[0].scheduled[0].want_prompt_logprobs
    assert seq.num_cached_tokens == 0
    assert seq.prompt_logprobs[0] is None
    assert [lp.token_id for lp in seq.prompt_logprobs[1:]] == p[1:]


def test_n_children_share_the_prompt_blocks_and_differ_by_seed_offset():
    sched, runner = make(max_num_batched_tokens=8)
    p = prompt(14)  # 3 full blocks of 4 + 2
    seqs = add(sched, p, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=6))
    first = seqs[0]
    out = step(sched, runner)
    assert [s.seq_id for s in out.scheduled] == [first.seq_id]  # children wait for the prompt
    out = step(sched, runner)
    assert [s.seq_id for s in out.scheduled] == [first.seq_id]
    out = step(sched, runner)  # prompt done last step: children take its full blocks
    children = [s for s in out.scheduled if s.seq_id != first.seq_id]
    assert [(c.start_pos, c.token_ids, c.seed_offset) for c in children] == [
        (12, p[12:], 1), (12, p[12:], 2)]
    assert all(c.prefix_token_ids == p[:12] for c in children)
    for child in seqs[1:]:
        assert child.block_ids[:3] == first.block_ids[:3]
    assert [sched.block_manager.pool.blocks[b].ref_count for b in first.block_ids[:3]] == [3, 3, 3]
    run_all(sched, runner)
    outs = [s.output_token_ids for s in seqs]
    assert len({tuple(o) for o in outs}) == 3 and all(len(o) == 6 for o in outs)


def test_n_children_share_without_prefix_caching_and_after_the_first_finished():
    sched, runner = make(max_num_seqs=1, enable_prefix_caching=False)
    seqs = add(sched, prompt(9), SamplingParams(n=2, max_tokens=3))
    run_all(sched, runner)  # max_num_seqs=1: child 1 starts only after child 0 finished
    assert all(s.num_output_tokens == 3 for s in seqs)
