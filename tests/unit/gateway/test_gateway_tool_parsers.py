"""Tool-call parsers (named, "required", hermes): fed whole or in any chunking they give the same
calls and content; a stream never shows half a hermes tag; bad calls come back as content."""

from __future__ import annotations

import json
import random

import pytest

from shoal.services.gateway.openai.tool_parsers import (HermesToolCalls, NamedToolCall, ParsedDelta,
                                                 RequiredToolCalls, ToolCallParser, make_parser)


def collect(parser: ToolCallParser,
            chunks: list[str]) -> tuple[str, list[dict[str, str]], list[ParsedDelta]]:
    """Feed the chunks, then finish: (content, calls as {id, name, arguments}, every delta)."""
    deltas = [parser.feed(chunk) for chunk in chunks] + [parser.finish()]
    content = "".join(d.content for d in deltas)
    calls: list[dict[str, str]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                assert c.index == len(calls) and c.name
                calls.append({"id": c.id, "name": c.name, "arguments": ""})
            else:
                assert c.name is None
            calls[c.index]["arguments"] += c.arguments
    return content, calls, deltas


def chunkings(text: str, seed: int = 0) -> list[list[str]]:
    """Whole, one character at a time, and random cuts."""
    rng = random.Random(seed)
    out = [[text], list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


def simple(calls: list[dict[str, str]]) -> list[tuple[str, object]]:
    return [(c["name"], json.loads(c["arguments"])) for c in calls]


HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
          '"unit": "c"}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
          '{"zone": "CET"}}\n</tool_call>\n')


@pytest.mark.parametrize("chunks", chunkings(HERMES))
def test_hermes_gives_the_same_calls_and_content_in_any_chunking(chunks) -> None:
    content, calls, deltas = collect(HermesToolCalls(), chunks)
    assert content == "Let me check.\n"
    assert simple(calls) == [("get_weather", {"city": "Paris", "unit": "c"}),
                             ("get_time", {"zone": "CET"})]
    assert all(c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert not any("<" in d.content for d in deltas)  # never half a tag in the stream


def test_hermes_plain_text_streams_and_holds_back_only_a_possible_tag() -> None:
    parser = HermesToolCalls()
    assert parser.feed("The answer is 4 <").content == "The answer is 4 "
    assert parser.feed("tool").content == ""
    assert parser.feed("s> are fine").content == "<tools> are fine"
    assert parser.finish() == ParsedDelta()
    content, calls, _ = collect(HermesToolCalls(), ["a < b", " <tool_c"])
    assert content == "a < b <tool_c" and calls == []


def test_hermes_bad_json_is_content_and_an_unclosed_last_call_still_counts() -> None:
    bad = '<tool_call>{"name": oops}</tool_call> then text'
    content, calls, _ = collect(HermesToolCalls(), list(bad))
    assert calls == [] and content == bad
    content, calls, _ = collect(HermesToolCalls(), ['<tool_call>{"name": "f", "arguments": {}}'])
    assert content == "" and simple(calls) == [("f", {})]
    content, calls, _ = collect(HermesToolCalls(), ['<tool_call>{"name": "f", "argu'])
    assert calls == [] and content == '<tool_call>{"name": "f", "argu'


def test_hermes_text_after_a_call_is_kept_but_lone_whitespace_is_not() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n\nDone.'
    content, calls, _ = collect(HermesToolCalls(), list(text))
    assert content == "\n\nDone." and simple(calls) == [("f", {"x": 1})]


REQUIRED = ('[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
            '{"name": "get_time", "parameters": {"zone": "é\\"x"}}]')


@pytest.mark.parametrize("chunks", chunkings(REQUIRED, seed=1))
def test_required_array_gives_one_call_per_element_in_any_chunking(chunks) -> None:
    content, calls, deltas = collect(RequiredToolCalls(), chunks)
    assert content == ""
    assert simple(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {"zone": 'é"x'})]
    assert json.loads(calls[1]["arguments"]) == {"zone": 'é"x'}


def test_required_cut_short_is_returned_as_content() -> None:
    cut = '[{"name": "get_weather", "parameters": {"ci'
    assert collect(RequiredToolCalls(), list(cut))[:2] == (cut, [])
    first_only = REQUIRED[:REQUIRED.index(", {") + 3]
    content, calls, _ = collect(RequiredToolCalls(), [first_only])
    assert content == "" and simple(calls) == [("get_weather", {"city": "Paris"})]


def test_named_call_streams_its_arguments() -> None:
    content, calls, deltas = collect(NamedToolCall("get_weather"), ['{"city"', "", ': "Rome"}'])
    assert content == "" and simple(calls) == [("get_weather", {"city": "Rome"})]
    assert [len(d.tool_calls) for d in deltas] == [1, 0, 1, 0]


def test_make_parser_by_mode() -> None:
    assert isinstance(make_parser("named", "f"), NamedToolCall)
    assert isinstance(make_parser("required"), RequiredToolCalls)
    assert isinstance(make_parser("auto", parser_name="hermes"), HermesToolCalls)
    assert make_parser("auto", parser_name=None) is None
