"""Calls wrapped in start and end tags with content around them (hermes, qwen3_xml): text outside
the tags streams as content, a possible start of a tag held back; a call is sent whole once its
end tag (or the answer's end) closes it; a body that is no call is content, tags included.
Whitespace between and after calls is dropped (vLLM's parsers drop it too)."""

from __future__ import annotations

from typing import Any

from shoal.services.gateway.parsers.common import Calls, ParsedDelta, partial_tag


class TaggedCalls:
    start_tag = "<tool_call>"
    end_tag = "</tool_call>"

    def __init__(self, tools: dict[str, Any] | None = None) -> None:
        self.tools = tools or {}
        """Each offered function's parameters schema, by name."""
        self.buffer = ""
        self.in_call = False
        self.held = ""
        self.after_call = False
        """No text has come since the last call (whitespace there is held back)."""
        self.scanned = 0
        """How much of a call's body is known to hold no end tag (a long call is not searched
        again from its start at every delta)."""
        self.calls = Calls()

    def parse_body(self, body: str) -> list[tuple[str, Any]] | None:
        """The calls (name, arguments) in one tagged body; None: it is no call."""
        raise NotImplementedError

    def feed(self, text: str) -> ParsedDelta:
        self.buffer += text
        out = ParsedDelta()
        while True:
            if self.in_call:
                end = self.buffer.find(self.end_tag, self.scanned)
                if end < 0:
                    self.scanned = max(0, len(self.buffer) - len(self.end_tag) + 1)
                    break
                self.scanned = 0
                body, self.buffer = self.buffer[:end], self.buffer[end + len(self.end_tag):]
                self.in_call = False
                self._call(body, out)
                continue
            start = self.buffer.find(self.start_tag)
            if start < 0:
                keep = partial_tag(self.buffer, self.start_tag)
                self._content(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            self._content(self.buffer[:start], out)
            self.buffer = self.buffer[start + len(self.start_tag):]
            self.in_call = True
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.in_call:  # the answer ended inside a call: take it if it is complete
            self._call(self.buffer, out, closed=False)
        else:
            self._content(self.buffer, out)
        self.buffer, self.in_call = "", False
        return out

    def _call(self, body: str, out: ParsedDelta, closed: bool = True) -> None:
        calls = self.parse_body(body)
        if not calls:
            self._content(self.start_tag + body + (self.end_tag if closed else ""), out)
            return
        for name, arguments in calls:
            self.calls.add(out, name, arguments)
        self.held, self.after_call = "", True

    def _content(self, text: str, out: ParsedDelta) -> None:
        if self.after_call and not (self.held + text).strip():
            self.held += text  # whitespace right after a call: kept only if text follows
            return
        out.content += self.held + text
        self.held, self.after_call = "", False
