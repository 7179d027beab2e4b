"""Structured outputs on the real SmolLM2-135M: JSON-schema, regex, choice and grammar answers
hold, n > 1 children each follow the grammar, constrained requests leave the greedy tokens of
unconstrained ones in the same batch unchanged, and preemption by recompute keeps the tokens."""

from __future__ import annotations

import json
import re

import pytest

from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.slow

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Invent a person. Answer in JSON with name, age and city."}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


def assert_person(text: str) -> None:
    """jsonschema is not installed here: the schema's rules, checked by hand."""
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}, person
    assert isinstance(person["name"], str) and 1 <= len(person["name"]) <= 20
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 120
    assert person["city"] in ("Paris", "London", "Tokyo")


def guided(**spec: object) -> StructuredOutputsParams:
    return StructuredOutputsParams(**spec)


@pytest.fixture(scope="module")
def llm(gguf):
    from shoal.services.engine.frontend.llm import LLM

    return LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128,
               max_num_batched_tokens=256, num_threads=1)


def test_json_schema_answer_validates(llm) -> None:
    params = SamplingParams(temperature=0, max_tokens=80, structured_outputs=guided(json=PERSON))
    out = llm.chat(ASK, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert_person(out.text)
    free = llm.chat(ASK, SamplingParams(temperature=0, max_tokens=80), use_tqdm=False)[0]
    assert free.outputs[0].text != out.text  # the constraint changed the answer


def test_regex_choice_and_grammar_answers_match(llm) -> None:
    ask = [{"role": "user", "content": "What is the capital of France?"}]
    specs = {
        "regex": guided(regex=r"The answer is [A-Z][a-z]+\."),
        "choice": guided(choice=["Paris", "Lyon", "Marseille"]),
        "grammar": guided(grammar='root ::= "City: " city "!"\ncity ::= "Paris" | "Rome"'),
    }
    outs = llm.chat([ask] * 3, [SamplingParams(temperature=0, max_tokens=20, structured_outputs=s)
                                for s in specs.values()], use_tqdm=False)
    regex, choice, grammar = (o.outputs[0] for o in outs)
    assert re.fullmatch(r"The answer is [A-Z][a-z]+\.", regex.text), regex.text
    assert choice.text in ("Paris", "Lyon", "Marseille")
    assert grammar.text in ("City: Paris!", "City: Rome!")
    assert {regex.finish_reason, choice.finish_reason, grammar.finish_reason} == {"stop"}


def test_every_child_of_n_follows_the_schema(llm) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=80,
                            structured_outputs=guided(json=PERSON, disable_any_whitespace=True))
    outs = llm.chat(ASK, params, use_tqdm=False)[0].outputs
    assert len(outs) == 3
    for out in outs:
        assert out.finish_reason == "stop", out.text
        assert_person(out.text)
    assert len({o.text for o in outs}) > 1  # each child sampled its own way


def test_unconstrained_requests_keep_their_tokens_beside_constrained_ones(llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    json_params = SamplingParams(temperature=0, max_tokens=80,
                                 structured_outputs=guided(json=PERSON))
    prompts = [PROMPTS[0], "A person as JSON:", PROMPTS[1], "Another person:", PROMPTS[2]]
    params = [greedy, json_params, greedy, json_params, greedy]
    mixed = llm.generate(prompts, params, use_tqdm=False)
    assert [mixed[i].outputs[0].token_ids for i in (0, 2, 4)] == alone
    for i in (1, 3):
        assert mixed[i].outputs[0].finish_reason == "stop", mixed[i].outputs[0].text
        assert_person(mixed[i].outputs[0].text)


def test_preemption_keeps_constrained_tokens(gguf) -> None:
    from shoal.services.engine.frontend.llm import LLM

    # fp32 weights on both sides: with the file's blocks a recompute (many rows, bf16 GEMM) and
    # the decode it replaces (int8 activations) round differently and may flip a near-tie.
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=guided(json=PERSON))
    prompts = [f"Person number {i} as JSON:" for i in range(3)]
    dense = LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128, num_threads=1,
                quantization="none")
    expected = [o.outputs[0] for o in dense.generate(prompts, params, use_tqdm=False)]
    tiny = LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=5, block_size=16,
               enable_prefix_caching=False, num_threads=1, quantization="none")
    outputs = [o.outputs[0] for o in tiny.generate(prompts, params, use_tqdm=False)]
    assert tiny.engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    for out in outputs:
        assert out.finish_reason == "stop", out.text
        assert_person(out.text)


def test_a_grammar_that_never_ends_is_refused_and_a_dead_end_fails_the_request(llm) -> None:
    """`root ::= root` is refused before anything runs (it once answered 'ectable': sampled
    from a row the grammar had all masked). A grammar that can end but whose branch after "x"
    cannot (the logit bias takes that branch) fails with a 400 at that token, not garbage;
    the engine serves the next request as before."""
    from shoal.shared.errors import InvalidRequest

    with pytest.raises(InvalidRequest) as err:
        llm.generate(PROMPTS[0], SamplingParams(structured_outputs=guided(grammar="root ::= root")),
                     use_tqdm=False)
    assert err.value.param == "structured_outputs.grammar" and "no finite" in err.value.message
    x = llm.get_tokenizer().encode("x", add_special_tokens=False)
    assert len(x) == 1
    dead_end = SamplingParams(temperature=0, max_tokens=8, logit_bias={x[0]: 100.0},
                              structured_outputs=guided(grammar='root ::= "x" dead | "y"\n'
                                                                'dead ::= dead'))
    free = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(InvalidRequest) as err:
        llm.generate([PROMPTS[0], PROMPTS[1]], [dead_end, free], use_tqdm=False)
    assert err.value.param == "structured_outputs.grammar"
    assert "allows no token after 1 generated tokens" in err.value.message, err.value.message
    stats = llm.engine.stats()
    assert stats.num_running == stats.num_waiting == 0
    after = llm.generate(PROMPTS[1], free, use_tqdm=False)[0].outputs[0]
    assert len(after.token_ids) == 6
