"""What every answer parser shares: tool-call deltas in OpenAI's streamed shape, and holding back
a possible start of a tag so a stream never shows half of one."""

from __future__ import annotations

import json
import secrets
import string
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

ALPHANUMERIC = string.ascii_letters + string.digits


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def short_call_id() -> str:
    """Mistral's templates refuse any id but 9 letters and digits (vLLM makes the same)."""
    return "".join(secrets.choice(ALPHANUMERIC) for _ in range(9))


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


def arguments_text(arguments: Any) -> str:
    """Arguments as OpenAI sends them: JSON text (a model may already give it as a string)."""
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def skip_space(text: str, pos: int, also: str = "") -> int:
    while pos < len(text) and (text[pos].isspace() or text[pos] in also):
        pos += 1
    return pos


def partial_tag(text: str, *tags: str) -> int:
    """The length of the longest end of `text` that begins one of `tags` (held back: it may be
    one)."""
    best = 0
    for tag in tags:
        for size in range(min(len(tag) - 1, len(text)), best, -1):
            if text.endswith(tag[:size]):
                best = size
                break
    return best


class Calls:
    """Numbers a choice's calls and makes each one's single delta."""

    def __init__(self, make_id: Any = new_call_id) -> None:
        self.count = 0
        self.make_id = make_id

    def add(self, out: ParsedDelta, name: str, arguments: Any) -> None:
        out.tool_calls.append(ToolCallDelta(self.count, self.make_id(), name,
                                            arguments_text(arguments)))
        self.count += 1


def call_fields(item: Any, *argument_keys: str) -> tuple[str, Any] | None:
    """(name, arguments) of a JSON call object, None if it is no call."""
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        return None
    for key in argument_keys:
        if key in item:
            return item["name"], item[key]
    return item["name"], {}
