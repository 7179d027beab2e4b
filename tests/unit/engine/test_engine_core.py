"""EngineCore over a fake runner: outputs (cumulative, delta, final only), stop strings and
stop tokens, n > 1, abort, logprobs, validation and the stats counters."""

from __future__ import annotations

import pytest

from tests.unit.engine.engine_helpers import EOS, CharTokenizer, FakeRunner, assert_scheduler_whole
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.engine_core import EngineCore
from shoal.services.engine.core.request_output import RequestOutput, RequestOutputKind
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest

A = 26  # token id of "a" for CharTokenizer


def make_core(runner: FakeRunner | None = None, **cfg) -> EngineCore:
    runner = runner or FakeRunner(num_kv_blocks=64, block_size=4)
    return EngineCore(EngineConfig(model="fake", block_size=runner.block_size, **cfg),
                      runner=runner, tokenizer=CharTokenizer())


def drain(core: EngineCore) -> list[RequestOutput]:
    outputs = []
    while core.has_unfinished():
        outputs.extend(core.step())
    assert_scheduler_whole(core.scheduler)
    assert core.scheduler.block_manager.num_free_blocks == core.runner.num_kv_blocks
    return outputs


def letters(word: str) -> list[int]:
    return [A + ord(c) - ord("a") for c in word]


def scripted(text_ids: list[int], prompt_len: int):
    return lambda context, seed_offset: text_ids[len(context) - prompt_len]


def test_cumulative_outputs_grow_until_length():
    core = make_core()
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=4))
    outputs = drain(core)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1, 2, 3, 4]
    last = outputs[-1]
    assert last.finished and not any(o.finished for o in outputs[:-1])
    completion = last.outputs[0]
    assert completion.finish_reason == "length" and completion.stop_reason is None
    assert completion.text == CharTokenizer().decode(completion.token_ids)
    assert completion.cumulative_logprob is None and completion.logprobs is None
    m = last.metrics
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time


def test_delta_outputs_add_up_to_the_cumulative_result():
    cumulative, delta = make_core(), make_core()
    cumulative.add_request("r", [5, 6], SamplingParams(max_tokens=7, stop=["zz"]))
    delta.add_request("r", [5, 6], SamplingParams(max_tokens=7, stop=["zz"]),
                      output_kind=RequestOutputKind.DELTA)
    final = drain(cumulative)[-1].outputs[0]
    deltas = drain(delta)
    assert "".join(o.outputs[0].text for o in deltas) == final.text
    assert sum((o.outputs[0].token_ids for o in deltas), []) == final.token_ids
    assert deltas[-1].finished and deltas[-1].outputs[0].finish_reason == "length"


def test_a_stop_string_finishes_the_sequence_and_is_not_in_the_text():
    runner = FakeRunner(block_size=4)
    runner.next_token = scripted(letters("abcdefgh"), prompt_len=2)
    core = make_core(runner)
    core.add_request("r", [1, 2], SamplingParams(max_tokens=8, stop=["de"]),
                     output_kind=RequestOutputKind.DELTA)
    outputs = drain(core)
    assert "".join(o.outputs[0].text for o in outputs) == "abc"
    final = outputs[-1].outputs[0]
    assert final.finish_reason == "stop" and final.stop_reason == "de"
    assert len(sum((o.outputs[0].token_ids for o in outputs), [])) == 5  # a b c d e
    assert all("d" not in o.outputs[0].text for o in outputs)  # never streamed, then retracted


def test_stop_strings_wait_for_min_tokens():
    runner = FakeRunner(block_size=4)
    runner.next_token = scripted(letters("xyxyxyxy"), prompt_len=2)
    core = make_core(runner)
    core.add_request("r", [1, 2], SamplingParams(max_tokens=8, min_tokens=3, stop=["x"]))
    final = drain(core)[-1].outputs[0]
    assert len(final.token_ids) == 5 and final.stop_reason == "x" and final.text == "xyxy"


@pytest.mark.parametrize("include", [False, True])
def test_eos_and_stop_tokens_end_the_text(include):
    runner = FakeRunner(block_size=4)
    runner.next_token = scripted(letters("ab") + [EOS], prompt_len=2)
    core = make_core(runner)
    core.add_request("eos", [1, 2], SamplingParams(max_tokens=8, include_stop_str_in_output=include,
                                                    skip_special_tokens=False))
    final = drain(core)[-1].outputs[0]
    assert final.token_ids == letters("ab") + [EOS] and final.finish_reason == "stop"
    assert final.text == ("ab<eos>" if include else "ab") and final.stop_reason is None
    runner.next_token = scripted(letters("abc"), prompt_len=2)
    core.add_request("tok", [1, 2], SamplingParams(max_tokens=8, stop_token_ids=[letters("b")[0]]))
    final = drain(core)[-1].outputs[0]
    assert final.text == "a" and final.stop_reason == letters("b")[0]


def test_n_children_and_final_only():
    core = make_core()
    core.add_request("r", list(range(1, 10)), SamplingParams(n=3, seed=7, max_tokens=5),
                     output_kind=RequestOutputKind.FINAL_ONLY)
    outputs = drain(core)
    assert len(outputs) == 1 and outputs[0].finished
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in outputs[0].outputs}) == 3


def test_abort_returns_a_final_output_and_frees_everything():
    core = make_core()
    core.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50),
                     output_kind=RequestOutputKind.DELTA)
    core.add_request("b", [4, 5, 6], SamplingParams(max_tokens=3))
    core.step()
    core.step()
    final = core.abort("a")
    assert final is not None and final.finished and final.outputs[0].finish_reason == "abort"
    assert core.abort("a") is None and core.abort("unknown") is None
    outputs = drain(core)
    assert all(o.request_id == "b" for o in outputs)
    assert core.runner.dropped >= {0}


def test_logprobs_and_prompt_logprobs_reach_the_output():
    core = make_core(FakeRunner(block_size=4, logprobs=True), max_num_batched_tokens=4)
    core.add_request("r", list(range(1, 11)),
                     SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=0))
    final = drain(core)[-1]
    completion = final.outputs[0]
    assert [lp.token_id for lp in completion.logprobs] == completion.token_ids
    assert completion.cumulative_logprob == pytest.approx(-1.5)
    assert final.prompt_logprobs[0] is None
    assert [lp.token_id for lp in final.prompt_logprobs[1:]] == list(range(2, 11))


def test_invalid_requests_are_refused_before_queueing():
    core = make_core(max_model_len=None)
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", [1, 2, 10_000], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequest) as err:  # an id past the vocabulary
        core.add_request("r", [1, 2], SamplingParams(logit_bias={core.vocab_bound: 1.0}))
    assert err.value.param == "logit_bias"
    with pytest.raises(InvalidRequest):
        core.add_request("r", [1] * 600, SamplingParams())  # longer than max_model_len 512
    core.add_request("r", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", [1, 2], SamplingParams())
    assert err.value.param == "request_id"
    drain(core)
    assert not core.has_unfinished()


def test_stats_count_tokens_preemptions_and_prefix_hits():
    core = make_core(FakeRunner(num_kv_blocks=10, block_size=4))
    prompt = list(range(1, 10))
    core.add_request("a", prompt, SamplingParams(max_tokens=4))
    drain(core)
    core.add_request("b", prompt, SamplingParams(max_tokens=4))
    stats = core.stats()
    assert stats.num_waiting == 1 and stats.num_running == 0
    core.step()
    stats = core.stats()
    assert stats.num_running == 1 and stats.kv_cache_usage == pytest.approx(3 / 10)
    outputs = drain(core)
    assert outputs[-1].num_cached_tokens == 8
    stats = core.stats()
    assert stats.prompt_tokens == 18 and stats.generation_tokens == 8
    assert stats.prefix_cache_queries == 18 and stats.prefix_cache_hits == 8
    assert stats.kv_cache_usage == 0.0 and stats.num_preemptions == 0
