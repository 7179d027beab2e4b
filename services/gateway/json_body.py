"""Reading a JSON request body (pure): an object, nested at most MAX_JSON_DEPTH deep, holding
only finite numbers, validated by a pydantic model. Anything else is an InvalidRequest (400)
naming the param, never a RecursionError or a ValidationError (500)."""

from __future__ import annotations

import json
import math
from collections import deque
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from shoal.shared.errors import InvalidRequest

T = TypeVar("T", bound=BaseModel)
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}
MAX_JSON_DEPTH = 64
"""Deeper request bodies are refused (OpenAI allows 5 levels of nesting in a JSON schema)."""


def json_depth(data: object) -> int:
    """How deeply arrays and objects nest (iterative: a deep value cannot exhaust the stack).
    A string (key or value) with a lone surrogate escape (`"\\ud800"`), which json.loads accepts
    but no UTF-8 encoder can write back, is an InvalidRequest: it could go nowhere; so is a
    number that is not finite (below)."""
    deepest, todo, finite = 0, [(data, 1)], True
    while todo:
        value, depth = todo.pop()
        if isinstance(value, dict):
            children = list(value.values())
            _check_text(*value.keys())
        elif isinstance(value, list):
            children = value
        else:
            if isinstance(value, str):
                _check_text(value)
            elif isinstance(value, float) and not math.isfinite(value):
                finite = False
            continue
        deepest = max(deepest, depth)
        todo.extend((child, depth + 1) for child in children)
    if not finite:
        _refuse_non_finite(data)
    return deepest


def _refuse_non_finite(data: object) -> None:
    """The InvalidRequest for the first number that is not finite, naming where it is.

    json.loads reads `1e309` as infinity and accepts `NaN` and `Infinity`, none of which JSON
    can write back: on the bus such a value would reach the engine as null (a 503 "malformed
    reply" that clients retry). vLLM refuses it with a 400 as well."""
    todo: deque[tuple[object, tuple[str, ...]]] = deque([(data, ())])
    while todo:
        value, path = todo.popleft()
        if isinstance(value, float) and not math.isfinite(value):
            param = ".".join(path) or None
            raise InvalidRequest(f"{param or 'body'}: must be a finite number, got {value!r} "
                                 "(JSON has no infinity or NaN; 1e309 and beyond overflow)",
                                 param=param)
        if isinstance(value, dict):
            todo.extend((v, (*path, str(k))) for k, v in value.items())
        elif isinstance(value, list):
            todo.extend((v, (*path, str(i))) for i, v in enumerate(value))


def _check_text(*texts: str) -> None:
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequest("the body holds a lone UTF-16 surrogate (\\ud800-\\udfff), "
                                 "which is not text", code="invalid_json") from None


def load_json(raw: bytes) -> dict[str, Any]:
    """A JSON object body, nested at most MAX_JSON_DEPTH deep; anything else is a 400.

    json.loads itself raises RecursionError on thousands of levels, and a value just under
    that would make pydantic, JSON schema compilers and the bus encoder recurse as deep."""
    try:
        data = json.loads(raw)
    except RecursionError:
        raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels",
                             code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"the body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise InvalidRequest("the body must be a JSON object", code="invalid_json")
    if json_depth(data) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"the body nests deeper than {MAX_JSON_DEPTH} levels",
                             code="invalid_json")
    return data


def _param(loc: tuple[int | str, ...]) -> str | None:
    parts: list[str] = []
    for item in loc:
        text = str(item)
        if isinstance(item, str) and ("[" in text or "-" in text or text in _TYPE_TAGS):
            continue
        parts.append(text)
    return ".".join(parts) or None


def parse_body(raw: bytes, model: type[T]) -> T:
    """Decode and validate a JSON body; any problem is an InvalidRequest naming the param."""
    data = load_json(raw)
    try:
        body = model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param(tuple(first.get("loc", ())))
        raise InvalidRequest(f"{param or 'body'}: {first['msg']}", param=param) from None
    check = getattr(body, "check", None)
    if check is not None:
        check()
    return body
