"""One request's outputs on their way from the engine thread to the reader on an event loop:
OutputCollector folds deltas together while the reader is behind (vLLM's
RequestOutputCollector), and RequestStream is what the reader iterates.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.services.engine.core.request_output import RequestOutput, RequestOutputKind


@dataclass(slots=True)
class OutputCollector:
    """What the engine produced for one request and its reader has not taken yet."""

    loop: asyncio.AbstractEventLoop
    kind: RequestOutputKind
    pending: RequestOutput | BaseException | None = None
    ready: asyncio.Event = field(default_factory=asyncio.Event)

    def put(self, item: RequestOutput | BaseException) -> None:
        """On the loop. Deltas merge; a cumulative or final output replaces; an error wins."""
        pending = self.pending
        if (isinstance(item, RequestOutput) and isinstance(pending, RequestOutput)
                and self.kind is RequestOutputKind.DELTA):
            pending.merge(item)
        elif not isinstance(pending, BaseException):
            self.pending = item
        self.ready.set()

    async def get(self) -> RequestOutput | BaseException:
        while self.pending is None:
            await self.ready.wait()
            self.ready.clear()
        item, self.pending = self.pending, None
        return item


def put_all(batch: list[tuple[OutputCollector, RequestOutput | BaseException]]) -> None:
    """One loop callback per engine step delivers every request's output."""
    for collector, item in batch:
        collector.put(item)


class RequestStream:
    """The outputs of one request, as an async iterator. It ends after the final output (or
    raises the engine's error); close() before that aborts the request."""

    def __init__(self, request_id: str, collector: OutputCollector, *,
                 on_done: Callable[[], None], abort: Callable[[], None]) -> None:
        self.request_id = request_id
        self._collector = collector
        self._on_done = on_done
        self._abort = abort
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._collector.get()
        if isinstance(item, BaseException):
            self._finish()
            raise item
        if item.finished:
            self._finish()
        return item

    def close(self) -> None:
        """Abort the request unless it has finished (safe to call more than once)."""
        if not self._done:
            self._finish()
            self._abort()

    def _finish(self) -> None:
        self._done = True
        self._on_done()
