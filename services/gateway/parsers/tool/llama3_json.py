"""vLLM's `llama3_json` parser (Llama 3.1 / 3.2 / 3.3 with JSON tool calling): an answer that
begins (after whitespace) with `<|python_tag|>` or `{` is calls, `{"name": ..., "parameters":
{...}}` objects separated by `;`; any other answer is content. Each call is sent once its object
is complete; text that is no call ends the calls and is content (all of the answer when no call
came before it)."""

from __future__ import annotations

import json
from typing import Literal

from shoal.services.gateway.parsers.common import Calls, ParsedDelta, call_fields, skip_space

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolCalls:
    def __init__(self, tools: object = None) -> None:
        self.buffer = ""
        self.pos = 0
        self.mode: Literal["start", "calls", "content"] = "start"
        self.calls = Calls()
        self._decoder = json.JSONDecoder()

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "content":
            out.content = text
            return out
        self.buffer += text
        if self.mode == "calls" and "}" not in text:
            return out  # no object can have ended: not worth decoding again
        if self.mode == "start":
            i = skip_space(self.buffer, 0)
            rest = self.buffer[i:]
            if not rest or (PYTHON_TAG.startswith(rest) and rest != PYTHON_TAG):
                return out  # whitespace, or maybe the tag: wait
            if rest.startswith(PYTHON_TAG):
                self.mode, self.pos = "calls", i + len(PYTHON_TAG)
            elif rest.startswith("{"):
                self.mode, self.pos = "calls", i
            else:
                return self._to_content(0, out)
        while True:
            i = skip_space(self.buffer, self.pos, also=";")
            if i >= len(self.buffer):
                return out
            try:
                item, end = self._decoder.raw_decode(self.buffer, i)
            except json.JSONDecodeError:
                return out  # incomplete (or never a call: decided at the end)
            call = call_fields(item, "parameters", "arguments")
            if call is None:
                return self._to_content(i if self.calls.count else 0, out)
            self.calls.add(out, *call)
            self.pos = end

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "calls":
            start = skip_space(self.buffer, self.pos, also=";") if self.calls.count else 0
            out.content = self.buffer[start:]
        elif self.mode == "start":
            out.content = self.buffer
        self.mode, self.buffer = "content", ""
        return out

    def _to_content(self, start: int, out: ParsedDelta) -> ParsedDelta:
        out.content += self.buffer[start:]
        self.mode, self.buffer = "content", ""
        return out
