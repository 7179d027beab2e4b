"""vLLM's `pythonic` parser (Llama 3.2 / 4, ToolACE and other models that call tools in Python):
an answer that is one Python list of calls with keyword arguments, e.g.
`[get_weather(city="Paris"), get_time()]` (Llama 4 may wrap it in <|python_start|>...
<|python_end|>), is calls; any other answer is content. Whether the list is the whole answer is
only known at its end, so an answer that begins with `[` is held back until then; one that begins
otherwise streams as content."""

from __future__ import annotations

import ast
from typing import Any, Literal

from shoal.services.gateway.parsers.common import Calls, ParsedDelta, skip_space

PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"


class PythonicToolCalls:
    def __init__(self, tools: object = None) -> None:
        self.buffer = ""
        self.mode: Literal["start", "calls", "content"] = "start"

    def feed(self, text: str) -> ParsedDelta:
        if self.mode == "content":
            return ParsedDelta(content=text)
        self.buffer += text
        if self.mode == "start":
            rest = self.buffer[skip_space(self.buffer, 0):]
            if not rest or (PYTHON_START.startswith(rest) and rest != PYTHON_START):
                return ParsedDelta()
            if rest.startswith(("[", PYTHON_START)):
                self.mode = "calls"
            else:
                self.mode, content, self.buffer = "content", self.buffer, ""
                return ParsedDelta(content=content)
        return ParsedDelta()

    def finish(self) -> ParsedDelta:
        text, self.buffer, self.mode = self.buffer, "", "content"
        calls = parse_calls(text)
        if calls is None:
            return ParsedDelta(content=text)
        out, numbered = ParsedDelta(), Calls()
        for name, arguments in calls:
            numbered.add(out, name, arguments)
        return out


def parse_calls(text: str) -> list[tuple[str, dict[str, Any]]] | None:
    """The calls of a whole answer, None if it is not a list of calls with literal arguments."""
    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START):]
    body = body.replace(PYTHON_END, "").strip()
    if not body.startswith("["):
        return None
    try:
        tree = ast.parse(body, mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and not node.args and _name(node.func)):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return None
        if None in arguments or not _jsonable(arguments):  # **kwargs, or a set / bytes value
            return None
        calls.append((_name(node.func), arguments))
    return calls  # type: ignore[return-value]


def _name(func: ast.expr) -> str | None:
    """f or module.f (vLLM takes dotted names too)."""
    if isinstance(func, ast.Name):
        return func.id
    if isinstance(func, ast.Attribute) and (base := _name(func.value)):
        return f"{base}.{func.attr}"
    return None


def _jsonable(value: Any) -> bool:
    if isinstance(value, dict):
        return all(isinstance(k, str) and _jsonable(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return all(_jsonable(v) for v in value)
    return value is None or isinstance(value, (str, int, float, bool))
