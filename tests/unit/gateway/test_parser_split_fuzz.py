"""Split invariance, fuzzed: for texts built from each parser's own tags, call bodies and noise,
every parser reads the same content, calls and reasoning whether the text comes whole or cut at
any points (hypothesis picks texts and cuts). The fixtures say what the right reading is; this
says the reading never depends on where a stream's chunks end."""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shoal.services.gateway.parsers.reasoning import REASONING_PARSERS, reasoning_parser
from shoal.services.gateway.parsers.tool import TOOL_PARSERS, tool_parser

PIECES = ["<tool_call>", "</tool_call>", "<think>", "</think>", "[TOOL_CALLS]", "[ARGS]",
          "<|python_tag|>", "<|python_start|>", "<|python_end|>", "<function=f>", "</function>",
          "<parameter=x>", "</parameter>", '{"name": "f", "arguments": {"a": 1}}',
          '{"name": "g", "parameters": {}}', "[f(a=1)]", "[", "]", "{", "}", ";", ",", " ", "\n",
          "<", "tool", "call", "f", "42", '"', "é世", "text", "null", "true"]
CALLS = ['<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>',
         "<tool_call>\n<function=f>\n<parameter=x>\n5\n</parameter>\n</function>\n</tool_call>",
         '[TOOL_CALLS][{"name": "f", "arguments": {}}]', '[TOOL_CALLS]f[ARGS]{"a": 1}',
         '<|python_tag|>{"name": "f", "parameters": {}}', "[f(a=1), g(b='x')]",
         "<think>hmm</think>"]
"""Whole calls of each format, so a fuzzed text often holds real ones, not only their parts."""
TEXT = st.lists(st.sampled_from(PIECES + CALLS * 3), max_size=10).map("".join)
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def cut(text: str, points: list[int]) -> list[str]:
    cuts = sorted({p % (len(text) + 1) for p in points})
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def read_tools(name: str, chunks: list[str]) -> tuple[str, list[tuple[str, str]]]:
    parser = tool_parser(name, {"f": {"properties": {"x": {"type": "integer"}}}})
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    calls: list[list[Any]] = []
    for d in deltas:
        for c in d.tool_calls:
            if c.id is not None:
                calls.append([c.name, ""])
            calls[c.index][1] += c.arguments
    return "".join(d.content for d in deltas), [tuple(c) for c in calls]


def read_reasoning(name: str, chunks: list[str]) -> tuple[str, str]:
    parser = reasoning_parser(name)
    deltas = [parser.feed(c) for c in chunks] + [parser.finish()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@FUZZ
@given(text=TEXT, points=st.lists(st.integers(0, 400), max_size=12))
def test_tool_parsers_read_the_same_in_any_cut(text: str, points: list[int]) -> None:
    for name in TOOL_PARSERS:
        assert read_tools(name, cut(text, points)) == read_tools(name, [text]), name
        assert read_tools(name, list(text)) == read_tools(name, [text]), name


@FUZZ
@given(text=TEXT, points=st.lists(st.integers(0, 400), max_size=12))
def test_reasoning_parsers_split_the_same_in_any_cut(text: str, points: list[int]) -> None:
    for name in REASONING_PARSERS:
        whole = read_reasoning(name, [text])
        assert read_reasoning(name, cut(text, points)) == whole, name
        assert read_reasoning(name, list(text)) == whole, name
        reasoning, content = whole  # nothing is lost but the tags
        assert len(reasoning) + len(content) >= len(text) - len("<think></think>")
