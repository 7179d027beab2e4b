"""LLM (offline front end) over a fake runner: prompt forms, order, per-prompt params, chat."""

from __future__ import annotations

import pytest

from tests.unit.engine.engine_helpers import CharTokenizer, FakeRunner
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest


def make_llm(**cfg) -> LLM:
    return LLM("fake", runner=FakeRunner(num_kv_blocks=64, block_size=4),
               tokenizer_obj=CharTokenizer(),
               block_size=4, **cfg)


def test_generate_accepts_strings_token_ids_and_dicts_in_order():
    llm = make_llm(max_num_seqs=2)
    prompts = ["hello", [30, 31, 32], {"prompt": "abc"}, {"prompt_token_ids": [40, 41]}]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=3), use_tqdm=False)
    assert [o.prompt for o in outputs] == ["hello", None, "abc", None]
    assert [o.prompt_token_ids for o in outputs] == [
        CharTokenizer().encode("hello"), [30, 31, 32], CharTokenizer().encode("abc"), [40, 41]]
    assert all(o.finished and len(o.outputs[0].token_ids) == 3 for o in outputs)
    single = llm.generate("hello", SamplingParams(max_tokens=3), use_tqdm=False)
    assert single[0].outputs[0].token_ids == outputs[0].outputs[0].token_ids
    by_ids = llm.generate([30, 31, 32], SamplingParams(max_tokens=3), use_tqdm=True)
    assert by_ids[0].outputs[0].token_ids == outputs[1].outputs[0].token_ids


def test_one_sampling_params_per_prompt():
    llm = make_llm()
    outputs = llm.generate(["ab", "cd"],
                           [SamplingParams(max_tokens=2), SamplingParams(max_tokens=5)],
                           use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [2, 5]
    with pytest.raises(InvalidRequest):
        llm.generate(["ab", "cd"], [SamplingParams()], use_tqdm=False)


def test_a_bad_prompt_refuses_the_whole_batch_and_leaves_nothing_queued():
    llm = make_llm()
    with pytest.raises(InvalidRequest):
        llm.generate(["ab", [1] * 1000], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.engine.has_unfinished() or not llm.engine.step()
    assert llm.engine.stats().num_waiting == 0


def test_chat_renders_the_template_for_one_or_many_conversations():
    llm = make_llm()
    conversation = [{"role": "user", "content": "hi"}]
    one = llm.chat(conversation, SamplingParams(max_tokens=2), use_tqdm=False)
    assert one[0].prompt == "userhiassistant"
    many = llm.chat([conversation, [{"role": "user", "content": "yo"}]],
                    SamplingParams(max_tokens=2),
                    use_tqdm=False)
    assert [o.prompt for o in many] == ["userhiassistant", "useryoassistant"]
    assert many[0].outputs[0].token_ids == one[0].outputs[0].token_ids
    assert llm.get_tokenizer() is llm.engine.tokenizer
