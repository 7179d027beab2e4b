"""Tool calls out of an answer's text, fed delta by delta (streamed or not, the same code):
a named function (the text is its arguments), "required" (a JSON array of {name, parameters},
as vLLM's guided schema makes it) and the hermes parser for "auto" (<tool_call>{...}</tool_call>).

Pure. Each parser turns text deltas into content and tool-call deltas in OpenAI's streamed shape:
a call's first delta carries its id and name. A named call streams its arguments as they come;
"required" and hermes calls are sent whole, once their JSON is complete.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ToolCallDelta:
    index: int
    """The call's position among the choice's calls."""
    id: str | None = None
    """Set on a call's first delta only, with its name."""
    name: str | None = None
    arguments: str = ""
    """JSON text (a fragment of it while a named call streams)."""


@dataclass(slots=True)
class ParsedDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)


class ToolCallParser(Protocol):
    def feed(self, text: str) -> ParsedDelta:
        """The next text delta of the answer -> what can be sent now."""
        ...

    def finish(self) -> ParsedDelta:
        """The answer ended: whatever was held back."""
        ...


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
            i = _skip_space(self.text, self.pos)
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
            arguments = _arguments_text(item.get("parameters", {}))
            out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), item["name"],
                                                arguments))
            self.num_calls += 1
        return out

    def finish(self) -> ParsedDelta:
        if self.num_calls == 0 and self.text.strip():
            return ParsedDelta(content=self.text)
        return ParsedDelta()


class HermesToolCalls:
    """vLLM's hermes parser: calls are `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
    (Hermes, Qwen2.5 and most tool-tuned models); text outside them is content. A possible
    start of a tag is held back, so a stream never shows half a tag; a call whose JSON does not
    parse is returned as content, tags included. Whitespace between and after calls is dropped."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0
        self.held = ""

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while True:
            if self.in_call:
                end = self.buffer.find(HERMES_END)
                if end < 0:
                    break
                body, self.buffer = self.buffer[:end], self.buffer[end + len(HERMES_END):]
                self.in_call = False
                self._call(body, out)
                continue
            start = self.buffer.find(HERMES_START)
            if start < 0:
                keep = _partial_tag(self.buffer, HERMES_START)
                self._content(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._content(self.buffer[:start], out)
            self.buffer = self.buffer[start + len(HERMES_START):]
            self.in_call = True
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # the answer ended inside a call: take it if its JSON is complete
            self._call(self.buffer, out, closed=False)
        else:
            self._content(self.buffer, out)
        self.buffer, self.in_call = "", False
        return out

    def _call(self, body: str, out: ParsedDelta, closed: bool = True) -> None:
        try:
            call = json.loads(body)
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                raise ValueError("not a call")
        except ValueError:
            self._content(HERMES_START + body + (HERMES_END if closed else ""), out)
            return
        out.tool_calls.append(ToolCallDelta(self.num_calls, new_call_id(), call["name"],
                                            _arguments_text(call.get("arguments", {}))))
        self.num_calls += 1

    def _content(self, text: str, out: ParsedDelta) -> None:
        if self.num_calls and not (self.held + text).strip():
            self.held += text  # whitespace after a call: kept only if more text follows
            return
        out.content += self.held + text
        self.held = ""


def make_parser(kind: str, function_name: str | None = None,
                parser_name: str | None = None) -> ToolCallParser | None:
    """The parser for a tool mode ("named" | "required" | "auto"); None = plain text."""
    if kind == "named" and function_name is not None:
        return NamedToolCall(function_name)
    if kind == "required":
        return RequiredToolCalls()
    if kind == "auto" and parser_name == "hermes":
        return HermesToolCalls()
    return None


def _arguments_text(arguments: Any) -> str:
    """Arguments as OpenAI sends them: JSON text (a model may already give it as a string)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _skip_space(text: str, pos: int) -> int:
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: it may be one)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
