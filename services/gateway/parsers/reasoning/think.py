"""The <think>...</think> split that vLLM's reasoning parsers share: text in the tags is
reasoning, text after them content, the tags themselves neither. Fed delta by delta (a possible
start of a tag held back), so a stream splits exactly as the whole answer does; an answer that
ends while thinking (max_tokens) is reasoning up to its end."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shoal.services.gateway.parsers.common import partial_tag

START, END = "<think>", "</think>"
State = Literal["before", "thinking", "after"]


@dataclass(slots=True)
class ReasonedDelta:
    reasoning: str = ""
    content: str = ""
    thought: bool = False
    """Whether this delta was (partly) thinking: its tokens count as reasoning tokens."""


class ThinkParser:
    first: State = "before"
    """Where an answer starts: "thinking" when the model's output begins inside the tags."""

    def __init__(self) -> None:
        self.state: State = self.first
        self.started = False
        """A <think> was seen (a second one is text)."""
        self.buffer = ""

    def feed(self, text: str) -> ReasonedDelta:
        out = ReasonedDelta(thought=self.state == "thinking")
        if self.state == "after":
            out.content = text
            return out
        self.buffer += text
        while self.buffer:
            if self.state == "before":
                tags: tuple[str, ...] = (START,)
            else:  # thinking: until </think>; a first <think> is dropped
                tags = (END,) if self.started else (END, START)
            found = [(i, tag) for tag in tags if (i := self.buffer.find(tag)) >= 0]
            if not found:
                keep = partial_tag(self.buffer, *tags)
                self._emit(self.buffer[:len(self.buffer) - keep], out)
                self.buffer = self.buffer[len(self.buffer) - keep:]
                break
            i, tag = min(found)
            self._emit(self.buffer[:i], out)
            self.buffer = self.buffer[i + len(tag):]
            if tag == START:
                self.started, self.state, out.thought = True, "thinking", True
            else:
                self.state = "after"
                out.content += self.buffer
                self.buffer = ""
        return out

    def finish(self) -> ReasonedDelta:
        out = ReasonedDelta(thought=self.state == "thinking")
        self._emit(self.buffer, out)
        self.buffer = ""
        return out

    def _emit(self, text: str, out: ReasonedDelta) -> None:
        if self.state == "thinking":
            out.reasoning += text
        else:
            out.content += text
