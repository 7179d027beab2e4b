"""Tool calls out of an answer's text, by the request's tool_choice, fed delta by delta
(streamed or not, the same code): a named function (the text is its arguments), "required" (a
JSON array of {name, parameters}, as vLLM's guided schema makes it) and "auto", read by the
model's --tool-call-parser (services/gateway/parsers/tool/: hermes, llama3_json, mistral,
pythonic, qwen3_xml).

Pure. Each parser turns text deltas into content and tool-call deltas in OpenAI's streamed shape:
a call's first delta carries its id and name. A named call streams its arguments as they come;
the others send each call whole, once it is complete.
"""

from __future__ import annotations

import json
from typing import Any

from shoal.services.gateway.parsers.common import (
    ParsedDelta, ToolCallDelta, ToolCallParser, arguments_text, new_call_id, skip_space
)
from shoal.services.gateway.parsers.tool import TOOL_PARSERS, tool_parser
from shoal.services.gateway.parsers.tool.hermes import HermesToolCalls

__all__ = ["HermesToolCalls", "NamedToolCall", "OneCall", "ParsedDelta", "RequiredToolCalls",
           "ToolCallDelta", "ToolCallParser", "make_parser"]


class NamedToolCall:
    """tool_choice {"type": "function", "function": {"name": ...}}: the whole answer is the
    function's arguments (guided by its parameters schema), streamed as it comes."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.call_id: str | None = None

    def feed(self, text: str) -> ParsedDelta:
        if not text:
            return ParsedDelta()
        return ParsedDelta(tool_calls=[self._delta(text)])

    def finish(self) -> ParsedDelta:
        return ParsedDelta() if self.call_id else ParsedDelta(tool_calls=[self._delta("")])

    def _delta(self, text: str) -> ToolCallDelta:
        if self.call_id is None:
            self.call_id = new_call_id()
            return ToolCallDelta(0, self.call_id, self.name, text)
        return ToolCallDelta(0, arguments=text)


class RequiredToolCalls:
    """tool_choice "required": the answer is `[{"name": ..., "parameters": {...}}, ...]`; each
    element becomes a call as soon as it is complete. An answer that is no such array (cut by
    max_tokens) is returned as content."""

    def __init__(self) -> None:
        self.text = ""
        self.pos = 0
        self.num_calls = 0
        self.is_broken = False
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ParsedDelta:
        self.text += text
        out = ParsedDelta()
        while not self.is_broken:
            i = skip_space(self.text, self.pos)
            if i >= len(self.text):
                break
            if self.text[i] in "[,]":
                self.pos = i + 1
                continue
            try:
                item, end = self._decoder.raw_decode(self.text, i)
            except json.JSONDecodeError:
                break  # incomplete: wait for more text
            if not (isinstance(item, dict) and isinstance(item.get("name"), str)):
                self.is_broken = True
                break
            self.pos = end
            arguments = arguments_text(item.get("parameters", {}))
            out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), item["name"],
                                                arguments))
            self.num_calls += 1
        return out

    def finish(self) -> ParsedDelta:
        if self.num_calls == 0 and self.text.strip():
            return ParsedDelta(content=self.text)
        return ParsedDelta()


class OneCall:
    """parallel_tool_calls false: the first call only (a model may still write several)."""

    def __init__(self, inner: ToolCallParser) -> None:
        self.inner = inner

    def feed(self, text: str) -> ParsedDelta:
        return self._first(self.inner.feed(text))

    def finish(self) -> ParsedDelta:
        return self._first(self.inner.finish())

    @staticmethod
    def _first(parsed: ParsedDelta) -> ParsedDelta:
        parsed.tool_calls = [c for c in parsed.tool_calls if c.index == 0]
        return parsed


def make_parser(kind: str, function_name: str | None = None, parser_name: str | None = None,
                tools: dict[str, Any] | None = None,
                parallel: bool = True) -> ToolCallParser | None:
    """The parser for a tool mode ("named" | "required" | "auto"); None = plain text. `tools`:
    the offered functions' parameters schemas by name; `parallel` false keeps one call."""
    parser: ToolCallParser | None = None
    if kind == "named" and function_name is not None:
        parser = NamedToolCall(function_name)
    elif kind == "required":
        parser = RequiredToolCalls()
    elif kind == "auto" and parser_name in TOOL_PARSERS:
        parser = tool_parser(parser_name, tools)
    return parser if parser is None or parallel else OneCall(parser)
