"""Every tool and reasoning parser against its fixture corpus (tests/fixtures/): fed whole, byte
by byte and in random cuts, each reads the same calls, content and reasoning, and a stream never
shows half a tag. The registries name exactly what a deployment may configure."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest

from shoal.services.gateway.openai.tool_parsers import OneCall, make_parser
from shoal.services.gateway.parsers.common import ToolCallParser, partial_tag
from shoal.services.gateway.parsers.reasoning import REASONING_PARSERS, reasoning_parser
from shoal.services.gateway.parsers.tool import TOOL_PARSERS, tool_parser
from shoal.shared.schemas.infer import REASONING_PARSERS as REASONING_NAMES
from shoal.shared.schemas.infer import TOOL_CALL_PARSERS

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures"
TAGS = {"hermes": ["<tool_call>"], "qwen3_xml": ["<tool_call>"], "mistral": ["[TOOL_CALLS]"],
        "llama3_json": [], "pythonic": []}


def cases(folder: str) -> list[Any]:
    out = []
    for path in sorted((FIXTURES / folder).glob("*.json")):
        for case in json.loads(path.read_text()):
            out.append(pytest.param(path.stem, case, id=f"{path.stem}: {case['name']}"))
    return out


def chunkings(text: str, seed: int) -> list[list[str]]:
    """Whole, one character at a time, every two-piece cut, and random cuts."""
    rng = random.Random(seed)
    out = [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]
    for _ in range(30):
        k = rng.randint(1, max(1, min(len(text) - 1, 16)))
        cuts = sorted(rng.sample(range(1, len(text)), k=k)) if len(text) > 1 else []
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def run_tool_parser(parser: ToolCallParser, chunks: list[str]) -> tuple[str, list[Any], list[str]]:
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    calls: list[dict[str, str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name
                calls.append({"id": c.id, "name": c.name, "arguments": ""})
            calls[c.index]["arguments"] += c.arguments
    ids = [c["id"] for c in calls]
    assert len(set(ids)) == len(ids)
    parsed = [[c["name"], json.loads(c["arguments"])] for c in calls]
    return "".join(d.content for d in deltas), parsed, [d.content for d in deltas]


def test_the_registries_name_what_a_deployment_may_configure() -> None:
    assert set(TOOL_PARSERS) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSERS) == set(REASONING_NAMES)
    assert {p.stem for p in (FIXTURES / "tool_parsers").glob("*.json")} == set(TOOL_PARSERS) - {
        "qwen3_coder"}  # qwen3_xml's other name
    assert {p.stem for p in (FIXTURES / "reasoning_parsers").glob("*.json")} == set(
        REASONING_PARSERS)


@pytest.mark.parametrize(("parser_name", "case"), cases("tool_parsers"))
def test_tool_parser_fixture_in_any_chunking(parser_name: str, case: dict[str, Any]) -> None:
    text = case["text"]
    for chunks in chunkings(text, len(text)):
        content, calls, pieces = run_tool_parser(tool_parser(parser_name, case.get("tools")),
                                                 chunks)
        assert (content or None, calls) == (case["content"], case["calls"]), chunks
        for tag in TAGS[parser_name]:  # a stream never shows the start of a tag before it ends
            assert not any(partial_tag(p, tag) for p in pieces[:-1]), pieces


@pytest.mark.parametrize(("parser_name", "case"), cases("reasoning_parsers"))
def test_reasoning_parser_fixture_in_any_chunking(parser_name: str, case: dict[str, Any]) -> None:
    text = case["text"]
    for chunks in chunkings(text, len(text)):
        parser = reasoning_parser(parser_name)
        deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
        reasoning = "".join(d.reasoning for d in deltas)
        content = "".join(d.content for d in deltas)
        assert (reasoning or None, content or None) == (case["reasoning"], case["content"]), chunks


def test_parallel_tool_calls_false_keeps_the_first_call() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>')
    parser = make_parser("auto", parser_name="hermes", parallel=False)
    assert isinstance(parser, OneCall)
    assert run_tool_parser(parser, list(text))[1] == [["a", {}]]
    assert run_tool_parser(make_parser("auto", parser_name="hermes"), [text])[1] == [
        ["a", {}], ["b", {}]]
    required = make_parser("required", parallel=False)
    assert run_tool_parser(required, ['[{"name": "a", "parameters": {}}, '
                                      '{"name": "b", "parameters": {}}]'])[1] == [["a", {}]]


def test_required_with_parallel_tool_calls_false_is_guided_to_one_call() -> None:
    from shoal.services.gateway.openai.protocol import ChatCompletionRequest

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tool_choice":
            "required", "tools": [{"type": "function", "function": {"name": "f"}}]}
    one = ChatCompletionRequest.model_validate({**body, "parallel_tool_calls": False})
    assert one.generate("r").sampling.structured_outputs.json_["maxItems"] == 1
    many = ChatCompletionRequest.model_validate(body).generate("r")
    assert "maxItems" not in many.sampling.structured_outputs.json_


def test_mistral_ids_are_what_its_templates_accept() -> None:
    parser = tool_parser("mistral")
    delta = parser.feed('[TOOL_CALLS][{"name": "f", "arguments": {}}]')
    assert len(delta.tool_calls[0].id) == 9 and delta.tool_calls[0].id.isalnum()


def test_calls_stream_as_soon_as_they_are_complete() -> None:
    """llama3_json and mistral send a call when its JSON closes, before the answer ends."""
    parser = tool_parser("llama3_json")
    assert parser.feed('{"name": "a", "parameters": {}}').tool_calls[0].name == "a"
    parser = tool_parser("mistral")
    assert parser.feed("Hi").content == "Hi"
    assert parser.feed("[TOOL_CALLS]f[ARGS]{}").tool_calls[0].name == "f"


def test_reasoning_marks_the_deltas_that_were_thinking() -> None:
    parser = reasoning_parser("qwen3")
    assert [parser.feed(t).thought for t in ["hi ", "<think>", "x", "</think>", "y"]] == [
        False, True, True, True, False]
    parser = reasoning_parser("deepseek_r1")
    assert [parser.feed(t).thought for t in ["x", "</think>", "y"]] == [True, True, False]
