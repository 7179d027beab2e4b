"""vLLM's `mistral` parser: text up to the `[TOOL_CALLS]` token is content, then calls, in either
of Mistral's formats: a JSON list `[{"name": ..., "arguments": {...}}, ...]` (tokenizers before
v11) or `name[ARGS]{...}` per call, each after its own [TOOL_CALLS] (v11 and later). Call ids
are 9 letters and digits: Mistral's chat templates refuse any other id when the conversation
comes back. Each call is sent once its JSON is complete; text that is no call is content (from
its [TOOL_CALLS] on when no call came after that token)."""

from __future__ import annotations

import json
import re
from typing import Literal

from shoal.services.gateway.parsers.common import (
    Calls, ParsedDelta, call_fields, partial_tag, short_call_id, skip_space
)

TOOL_CALLS, ARGS, CALL_ID = "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]"
NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


class MistralToolCalls:
    def __init__(self, tools: object = None) -> None:
        self.buffer = ""
        self.pos = 0
        self.tag_pos = 0
        """Where the last [TOOL_CALLS] began."""
        self.since_tag = 0
        self.mode: Literal["content", "calls", "rest"] = "content"
        self.calls = Calls(short_call_id)
        self._decoder = json.JSONDecoder()
        self.failed_at: int | None = None
        """The buffer's length when a call's JSON last did not parse: it is not tried again
        until a "}" arrives (no JSON object can end without one)."""

    def feed(self, text: str) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "rest":
            out.content = text
            return out
        self.buffer += text
        if self.mode == "content":
            start = self.buffer.find(TOOL_CALLS)
            if start < 0:
                keep = partial_tag(self.buffer, TOOL_CALLS)
                out.content = self.buffer[:len(self.buffer) - keep]
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return out
            out.content = self.buffer[:start]
            self.buffer = self.buffer[start:]
            self.mode, self.pos, self.tag_pos, self.since_tag = "calls", len(TOOL_CALLS), 0, 0
        self._calls(out)
        return out

    def finish(self) -> ParsedDelta:
        out = ParsedDelta()
        if self.mode == "content":
            out.content = self.buffer
        elif self.mode == "calls":
            i = skip_space(self.buffer, self.pos, also=",]")
            if i < len(self.buffer):
                self._broken(i, out)
        self.mode, self.buffer = "rest", ""
        return out

    def _calls(self, out: ParsedDelta) -> None:
        """Read every call complete so far."""
        while self.mode == "calls":
            i = skip_space(self.buffer, self.pos)
            rest = self.buffer[i:]
            if not rest or (TOOL_CALLS.startswith(rest) and rest != TOOL_CALLS):
                return
            if rest.startswith(TOOL_CALLS):
                self.pos, self.tag_pos, self.since_tag = i + len(TOOL_CALLS), i, 0
            elif rest[0] in "[,]":
                self.pos = i + 1
            elif rest[0] == "{":
                if not self._json_call(i, out):
                    return
            elif not self._named_call(i, out):
                return

    def _decode(self, i: int) -> tuple[object, int] | None:
        """The JSON value at `i`, None while it is incomplete."""
        if self.failed_at is not None and "}" not in self.buffer[self.failed_at:]:
            return None
        try:
            value, end = self._decoder.raw_decode(self.buffer, i)
        except json.JSONDecodeError:
            self.failed_at = len(self.buffer)
            return None
        self.failed_at = None
        return value, end

    def _json_call(self, i: int, out: ParsedDelta) -> bool:
        decoded = self._decode(i)
        if decoded is None:
            return False
        item, end = decoded
        call = call_fields(item, "arguments", "parameters")
        if call is None:
            self._broken(i, out)
            return False
        self._add(out, call[0], call[1], end)
        return True

    def _named_call(self, i: int, out: ParsedDelta) -> bool:
        """`name[ARGS]{...}` (or `name[CALL_ID]id[ARGS]{...}`)."""
        k = self.buffer.find(ARGS, i)
        if k < 0:
            return False
        name = self.buffer[i:k].split(CALL_ID)[0].strip()
        j = skip_space(self.buffer, k + len(ARGS))
        if not NAME.fullmatch(name) or (j < len(self.buffer) and self.buffer[j] != "{"):
            self._broken(i, out)
            return False
        decoded = self._decode(j)
        if decoded is None:
            return False
        self._add(out, name, decoded[0], decoded[1])
        return True

    def _add(self, out: ParsedDelta, name: str, arguments: object, end: int) -> None:
        self.calls.add(out, name, arguments)
        self.pos = end
        self.since_tag += 1

    def _broken(self, i: int, out: ParsedDelta) -> None:
        """Text that is no call: it and all that follows are content."""
        out.content += self.buffer[self.tag_pos if self.since_tag == 0 else i:]
        self.mode, self.buffer = "rest", ""
