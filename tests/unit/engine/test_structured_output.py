"""Structured outputs, the pure pieces: spec validation, grammar parsing errors, the compile
cache, the bitmask on a toy vocabulary, and the sampler following a grammar step by step
(greedy and random, EOS once finished, min_tokens, preemption's token reset, n > 1)."""

from __future__ import annotations

import json
import re
import threading

import pytest
import torch
import xgrammar as xgr

from shoal.services.engine.runner.sampler import SeqState, sample
from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams
from shoal.services.engine.structured_output import matcher
from shoal.services.engine.structured_output.compiler import (GrammarCompiler, choice_ebnf,
                                                              to_grammar)
from shoal.services.engine.structured_output.matcher import GrammarState, apply_bitmask
from shoal.shared.errors import InvalidRequest

VOCAB = ["a", "b", "c", "1", "2", "{", "}", '"', ":", " ", "ab", "<eos>", "x"]
EOS = VOCAB.index("<eos>")
TOKEN = {text: i for i, text in enumerate(VOCAB)}


def toy_info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=len(VOCAB),
                             stop_token_ids=[EOS])


def compiled(**spec: object) -> xgr.CompiledGrammar:
    return GrammarCompiler(toy_info).compile(StructuredOutputsParams(**spec)).result(timeout=30)


def constrained_state(grammar: xgr.CompiledGrammar, prompt: list[int] | None = None,
                      **params: object) -> SeqState:
    p = SamplingParams(structured_outputs=StructuredOutputsParams(regex="."), **params)
    p = p.with_compiled_grammar(grammar)
    gen = None if p.is_greedy else torch.Generator().manual_seed(7)
    prompt = prompt or [TOKEN["x"]]
    return SeqState(params=p, token_ids=list(prompt), prompt_len=len(prompt), generator=gen)


def decode(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != EOS)


def run(states: list[SeqState], steps: int, logits_fn=None) -> list[list[int]]:
    """Drive sample() as the runner does: each sampled token is appended to token_ids (fed back
    next step); a sequence stops at EOS."""
    outputs: list[list[int]] = [[] for _ in states]
    live = list(range(len(states)))
    for _ in range(steps):
        if not live:
            break
        noise = torch.Generator().manual_seed(3)
        logits = (logits_fn(len(live)) if logits_fn
                  else torch.randn(len(live), len(VOCAB), generator=noise))
        tokens, _ = sample(logits, [states[i] for i in live], frozenset({EOS}))
        for i, token in zip(list(live), tokens):
            outputs[i].append(token)
            states[i].token_ids.append(token)
            if token == EOS:
                live.remove(i)
    return outputs


# ------------------------------------------------------------------ the spec
@pytest.mark.parametrize("spec,param", [
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["ok", ""]}, "structured_outputs.choice"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"grammar": 3}, "structured_outputs.grammar"),
    ({"bogus": 1}, "structured_outputs"),
])
def test_bad_specs_are_refused_naming_the_param(spec, param) -> None:
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(structured_outputs=spec)
    assert err.value.param == param and err.value.http_status == 400


@pytest.mark.parametrize("spec,param,fragment", [
    ({"json": {"type": "nonsense"}}, "structured_outputs.json", 'Unsupported type "nonsense"'),
    ({"json": {"$ref": "#/defs/missing"}}, "structured_outputs.json", "defs"),
    ({"regex": "(ab"}, "structured_outputs.regex", "parenthesis"),
    ({"grammar": 'root ::= "a" | '}, "structured_outputs.grammar", "EBNF"),
    ({"grammar": 'start ::= "a"'}, "structured_outputs.grammar", "root"),
])
def test_unparsable_schemas_and_grammars_are_invalid_requests(spec, param, fragment) -> None:
    with pytest.raises(InvalidRequest) as err:
        to_grammar(StructuredOutputsParams(**spec))
    assert err.value.param == param and fragment in err.value.message
    assert not err.value.message.startswith("invalid structured_outputs.json: [")  # no C++ noise


SELF_REF = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
LINKED = {"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}},
                             "required": ["next"]}}, "$ref": "#/$defs/node"}


@pytest.mark.parametrize("spec", [
    {"grammar": "root ::= root"},
    {"grammar": 'root ::= "x" root'},
    {"grammar": "root ::= a\na ::= b\nb ::= root"},
    {"grammar": 'root ::= item{1,3}\nitem ::= "[" item "]"'},
    {"json": {"$ref": "#"}},
    {"json": SELF_REF},
    {"json": LINKED},
    {"json": {"type": "array", "items": {"$ref": "#"}, "minItems": 1}},
])
def test_grammars_and_schemas_that_never_end_are_refused(spec) -> None:
    """xgrammar parses these, but no finite text matches them: its matcher then allows no
    token (so the sampler drew from nothing: 'ectable') or only ever more of them."""
    [kind] = spec
    with pytest.raises(InvalidRequest) as err:
        to_grammar(StructuredOutputsParams(**spec))
    assert err.value.param == f"structured_outputs.{kind}" and err.value.http_status == 400
    # ours, or xgrammar's own refusal (0.2.9 names a bare self-$ref before our check runs)
    assert ("no finite" in err.value.message
            or "Circular $ref chain" in err.value.message), err.value.message
    if kind == "json":
        assert "$ref" in err.value.message


@pytest.mark.parametrize("spec", [
    {"grammar": 'root ::= "x" root | "y"'},
    {"grammar": 'root ::= root "x" | "y"'},  # left recursion with a base case
    {"grammar": 'root ::= item{0,3}\nitem ::= "[" item "]"'},  # zero items end at once
    {"grammar": 'root ::= "y" | dead\ndead ::= dead'},  # a dead branch, not a dead root
    {"json": {"type": "object", "properties": {"a": {"$ref": "#"}}}},  # optional
    {"json": {"type": "array", "items": {"$ref": "#"}}},  # [] ends it
    {"json": {"$defs": {"node": {"type": "object", "properties": {
        "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["next"]}},
        "$ref": "#/$defs/node"}},
    {"regex": "(ab)*c"},
])
def test_recursion_with_a_way_out_is_accepted(spec) -> None:
    to_grammar(StructuredOutputsParams(**spec))


def test_choice_literals_survive_quotes_backslashes_and_newlines() -> None:
    choices = ['say "hi"', "back\\slash", "two\nlines", "é"]
    grammar = xgr.Grammar.from_ebnf(choice_ebnf(choices))
    info = xgr.TokenizerInfo([c for c in "".join(choices)] + ["<eos>"],
                             vocab_type=xgr.VocabType.RAW, stop_token_ids=[0])
    compiled_grammar = xgr.GrammarCompiler(info).compile_grammar(grammar)
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled_grammar)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    assert not xgr.GrammarMatcher(compiled_grammar).accept_string("say hi")


def test_key_is_the_same_for_a_schema_given_as_object_or_text() -> None:
    schema = {"type": "object", "properties": {"z": {"type": "string"}, "a": {"type": "integer"}}}
    as_text = StructuredOutputsParams(json=json.dumps(schema, indent=2))
    assert as_text.key == StructuredOutputsParams(json=schema).key
    assert as_text.key != StructuredOutputsParams(json=schema, disable_any_whitespace=True).key
    assert StructuredOutputsParams(regex="a").key != StructuredOutputsParams(grammar="a").key


# ------------------------------------------------------------------ the compile cache
def test_compiles_once_per_distinct_spec_and_evicts_least_recent() -> None:
    compiler = GrammarCompiler(toy_info, max_cached=2)
    first = compiler.compile(StructuredOutputsParams(regex="a+"))
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(StructuredOutputsParams(regex="b+")).result(timeout=30)
    first.result(timeout=30)
    assert compiler.num_compiled == 2
    compiler.compile(StructuredOutputsParams(regex="a+"))  # a+ becomes the most recent
    compiler.compile(StructuredOutputsParams(choice=["c"])).result(timeout=30)  # evicts b+
    assert compiler.compile(StructuredOutputsParams(regex="a+")) is first
    compiler.compile(StructuredOutputsParams(regex="b+")).result(timeout=30)
    assert compiler.num_compiled == 4


def test_tokenizer_info_is_built_on_the_compile_thread_at_first_use() -> None:
    threads: list[str] = []

    def make_info() -> xgr.TokenizerInfo:
        threads.append(threading.current_thread().name)
        return toy_info()

    compiler = GrammarCompiler(make_info)
    assert threads == []
    compiler.compile(StructuredOutputsParams(regex="a")).result(timeout=30)
    compiler.compile(StructuredOutputsParams(regex="b")).result(timeout=30)
    assert len(threads) == 1 and threads[0].startswith("shoal-grammar")


# ------------------------------------------------------------------ the bitmask
def test_bitmask_forbids_exactly_the_illegal_tokens_of_the_listed_rows() -> None:
    grammar = compiled(regex="a[bc]1")
    logits = torch.randn(3, len(VOCAB))
    before = logits.clone()
    state = GrammarState.create(grammar)
    apply_bitmask(logits, [1], [state])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    allowed = {i for i in range(len(VOCAB)) if logits[1, i] != float("-inf")}
    assert allowed == {TOKEN["a"], TOKEN["ab"]}
    assert torch.equal(logits[1, sorted(allowed)], before[1, sorted(allowed)])
    state.catch_up([TOKEN["ab"]])
    logits = torch.zeros(2, len(VOCAB))
    apply_bitmask(logits, [0], [state])
    assert {i for i in range(len(VOCAB)) if logits[0, i] == 0} == {TOKEN["1"]}


def test_a_finished_grammar_allows_only_eos_also_after_eos() -> None:
    state = GrammarState.create(compiled(choice=["ab"]))
    state.catch_up([TOKEN["ab"]])
    for extra in ([], [EOS], [EOS, EOS]):  # ignore_eos keeps sampling after the stop token
        state.catch_up([TOKEN["ab"], *extra])
        logits = torch.zeros(1, len(VOCAB))
        apply_bitmask(logits, [0], [state])
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]


def test_a_grammar_that_allows_no_token_gives_eos_and_is_flagged() -> None:
    """After "x" the grammar can never end: the row allows only EOS (never a draw from an
    all -inf row) and the state says so, for the engine to fail the request."""
    state = GrammarState.create(compiled(grammar='root ::= "x" dead | "a" "b"\ndead ::= dead'))
    logits = torch.zeros(1, len(VOCAB))
    apply_bitmask(logits, [0], [state])
    assert TOKEN["x"] in torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert not state.dead_end
    state.catch_up([TOKEN["x"]])
    logits = torch.zeros(1, len(VOCAB))
    apply_bitmask(logits, [0], [state])
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    assert state.dead_end


# ------------------------------------------------------------------ the sampler
def test_greedy_follows_the_grammar_against_the_model_and_ends_with_eos() -> None:
    grammar = compiled(regex="a[bc]+1")

    def prefer_x(rows: int) -> torch.Tensor:  # the "model" wants x, then 2, never the grammar
        logits = torch.zeros(rows, len(VOCAB))
        logits[:, TOKEN["x"]] = 10.0
        logits[:, TOKEN["2"]] = 5.0
        logits[:, TOKEN["1"]] = 1.0
        logits[:, TOKEN["c"]] = 0.5
        return logits

    out = run([constrained_state(grammar, temperature=0.0, max_tokens=None)], 12, prefer_x)[0]
    assert out[-1] == EOS and re.fullmatch("a[bc]+1", decode(out)), decode(out)
    assert decode(out) == "ac1"  # the best legal token each step


def test_random_draws_never_leave_the_grammar() -> None:
    grammar = compiled(json={"type": "object", "properties": {"a": {"type": "integer"}},
                             "required": ["a"]}, disable_any_whitespace=True)
    states = [constrained_state(grammar, temperature=1.5, top_p=0.9, top_k=5, seed=i)
              for i in range(8)]
    for i, s in enumerate(states):
        s.generator = torch.Generator().manual_seed(i)
    outputs = run(states, 40)
    for out in outputs:
        assert out[-1] == EOS, decode(out)
        assert isinstance(json.loads(decode(out))["a"], int)


def test_each_child_follows_its_own_tokens() -> None:
    """n > 1: two sequences on one compiled grammar, at different points of it."""
    grammar = compiled(regex="(ab|c)1")
    a = constrained_state(grammar, temperature=0.0)
    c = constrained_state(grammar, temperature=0.0)
    logits = torch.zeros(2, len(VOCAB))
    logits[0, TOKEN["ab"]] = 3.0
    logits[1, TOKEN["c"]] = 3.0
    tokens, _ = sample(logits, [a, c], frozenset({EOS}))
    assert tokens == [TOKEN["ab"], TOKEN["c"]]
    a.token_ids.append(tokens[0])
    c.token_ids.append(tokens[1])
    assert run([a, c], 3) == [[TOKEN["1"], EOS], [TOKEN["1"], EOS]]


def test_recompute_resets_the_runner_copy_without_confusing_the_matcher() -> None:
    """After preemption the runner refills token_ids with the same tokens; a fresh SeqState
    (grammar None) catches up from the output tokens alone."""
    grammar = compiled(regex="abc1")
    state = constrained_state(grammar, temperature=0.0)
    out = run([state], 2)[0]
    assert decode(out) == "ab"
    state.token_ids = list(state.token_ids)  # the runner's reset: the same tokens again
    fresh = SeqState(params=state.params, token_ids=list(state.token_ids),
                     prompt_len=state.prompt_len)
    assert run([state, fresh], 5) == [[TOKEN["c"], TOKEN["1"], EOS]] * 2


def test_min_tokens_cannot_stretch_a_finished_grammar() -> None:
    state = constrained_state(compiled(choice=["ab"]), temperature=1.0, min_tokens=5)
    out = run([state], 4)[0]  # "ab" is one token or two ("a", "b"): either way EOS comes next
    assert out[-1] == EOS and decode(out) == "ab" and len(out) <= 3


def test_logprobs_see_the_mask() -> None:
    state = constrained_state(compiled(regex="[ab]"), temperature=0.0, logprobs=2)
    _, lps = sample(torch.zeros(1, len(VOCAB)), [state], frozenset({EOS}))
    entry = lps[0]
    assert entry is not None and entry.logprob == pytest.approx(-0.6931, abs=1e-3)
    assert {t for t, _ in entry.top} == {TOKEN["a"], TOKEN["b"]}


def test_unconstrained_batches_do_no_grammar_work(monkeypatch) -> None:
    def boom(*args: object) -> None:
        raise AssertionError("bitmask work for an unconstrained batch")

    monkeypatch.setattr(matcher, "apply_bitmask", boom)
    monkeypatch.setattr(matcher.GrammarState, "create", boom)
    states = [SeqState(params=SamplingParams(temperature=0.0), token_ids=[1], prompt_len=1)
              for _ in range(3)]
    logits = torch.randn(3, len(VOCAB))
    tokens, _ = sample(logits.clone(), states, frozenset({EOS}))
    assert tokens == logits.argmax(-1).tolist() and all(s.grammar is None for s in states)
