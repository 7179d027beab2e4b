"""Server-sent events framing (pure): one `data: <json>` event per chunk, an error event, and the
closing `data: [DONE]`, as OpenAI and vLLM stream them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from shoal.services.gateway.openai.objects import OpenAIObject
from shoal.shared.errors import ShoalError

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
               "X-Accel-Buffering": "no"}


def sse_event(payload: dict[str, Any] | OpenAIObject) -> bytes:
    """One event; JSON never contains a raw newline, so one `data:` line is enough."""
    if isinstance(payload, OpenAIObject):
        data = payload.body_json()  # compact, UTF-8 as is: as json.dumps below
    else:
        data = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode()
    return b"data: " + data + b"\n\n"


def sse_error(error: ShoalError) -> bytes:
    """An error event in OpenAI's body shape (the SDKs raise an APIError on it)."""
    body = error.to_dict()
    body["status"] = error.http_status
    return sse_event({"error": body})


def parse_sse(raw: bytes) -> list[str]:
    """The data fields of a byte stream of events (tests and the load-test client use it)."""
    events = []
    for block in raw.decode().split("\n\n"):
        lines = [line[5:].lstrip() for line in block.split("\n") if line.startswith("data:")]
        if lines:
            events.append("\n".join(lines))
    return events


T = TypeVar("T")


async def after_first(first: T, rest: AsyncIterator[T]) -> AsyncIterator[T]:
    """`first` (read before the response began, to answer its errors with a status), then the
    rest: the stream routes that translate chat's entries into their own events."""
    yield first
    async for item in rest:
        yield item
