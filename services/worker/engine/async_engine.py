"""AsyncEngine: an EngineCore stepped on its own thread, so the model never blocks the
asyncio loop that serves streams and heartbeats. Requests and aborts cross over as commands;
a step's outputs come back in one loop.call_soon_threadsafe, into one collector per request
that folds deltas together while its reader is behind (vLLM's RequestOutputCollector): a busy
loop sends fewer, larger messages instead of falling further behind the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from shoal.services.worker.engine.config import EngineConfig
from shoal.services.worker.engine.engine_core import EngineCore
from shoal.services.worker.engine.request_output import (EngineStats, RequestOutput,
                                                         RequestOutputKind)
from shoal.services.worker.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest, ShoalError, Unavailable

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Stream:
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


@dataclass(slots=True)
class _Add:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float | None
    prompt: str | None
    output_kind: RequestOutputKind


class AsyncEngine:
    """An EngineCore on its own thread. Given a config, the thread builds the core itself: torch
    ran a step 1.5-1.8x slower (SmolLM2 on 2 CPU cores, batches of 32) on a thread other than
    the one that loaded the model, so loading and stepping share one thread."""

    def __init__(self, config: EngineConfig | None = None, *, core: EngineCore | None = None) -> None:
        if core is None and config is None:
            raise ValueError("AsyncEngine needs an EngineConfig or an EngineCore")
        self._lock = threading.Lock()
        self._commands: list[_Add | str] = []  # _Add, or a request id to abort
        self._wakeup = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self.core: EngineCore
        self._stats: EngineStats
        built: list[EngineCore | BaseException] = [core] if core is not None else []
        loaded = threading.Event()

        def build_then_run() -> None:
            if not built:
                try:
                    built.append(EngineCore(config))  # type: ignore[arg-type]
                except BaseException as exc:  # handed to the constructor, which raises it
                    built.append(exc)
            ready = built[0]
            if isinstance(ready, EngineCore):
                self.core, self._stats = ready, ready.stats()  # before the loop reads them
            loaded.set()
            if isinstance(ready, EngineCore):
                self._run()

        self._thread = threading.Thread(target=build_then_run, name="shoal-engine", daemon=True)
        self._thread.start()
        loaded.wait()
        if isinstance(built[0], BaseException):
            self._thread.join()
            raise built[0]

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._error is None

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (cheap; never waits for the engine)."""
        return self._stats

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, prompt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.DELTA) -> None:
        """Queue a request (InvalidRequest at once if it could never run). Its outputs go to
        the stream opened by generate(); most callers want generate() itself."""
        self._check_alive()
        self.core.check_request(list(prompt_token_ids), params)
        self._send(_Add(request_id, list(prompt_token_ids), params, arrival_time, prompt, output_kind))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None, *, prompt: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas by default) until it finishes. Stopping the
        iteration early, or cancelling the task, aborts the request."""
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        stream = _Stream(asyncio.get_running_loop(), output_kind)
        self._streams[request_id] = stream
        finished = False
        try:
            self.add_request(request_id, prompt_token_ids, params, arrival_time, prompt=prompt,
                             output_kind=output_kind)
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if self._streams.get(request_id) is stream:
                del self._streams[request_id]
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        """Abort a request wherever it is; its stream (if any) ends with finish_reason "abort"."""
        if self._error is None and not self._stopping:
            self._send(request_id)

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the step loop and fail the streams still open."""
        self._stopping = True
        self._wakeup.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        self._fail_all(Unavailable("the engine is shutting down"))

    def _send(self, command: _Add | str) -> None:
        with self._lock:
            self._commands.append(command)
        self._wakeup.set()

    def _check_alive(self) -> None:
        if self._error is not None:
            raise Unavailable(f"the engine failed: {self._error}")
        if self._stopping:
            raise Unavailable("the engine is shutting down")

    # The engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping:
                self._apply_commands()
                if not self.core.has_unfinished():
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = self.core.step()
                self._stats = self.core.stats()  # before delivery: a reader sees them together
                self._deliver_all([(output.request_id, output) for output in outputs])
        except BaseException as exc:  # fail every stream instead of leaving it hanging
            log.exception("engine step loop failed")
            self._error = exc
            error = Unavailable(f"the engine failed: {exc!r}")
            error.__cause__ = exc
            self._fail_all(error)

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
        items: list[tuple[str, RequestOutput | BaseException]] = []
        for command in commands:
            if isinstance(command, str):
                output = self.core.abort(command)
                if output is not None:
                    items.append((command, output))
                continue
            try:
                self.core.add_request(command.request_id, command.prompt_token_ids, command.params,
                                      command.arrival_time, prompt=command.prompt,
                                      output_kind=command.output_kind)
            except ShoalError as exc:  # e.g. a duplicate id that slipped past add_request
                items.append((command.request_id, exc))
        self._stats = self.core.stats()
        self._deliver_all(items)

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for a whole step (not one per request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None and not stream.loop.is_closed():
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # the loop closed meanwhile: nobody is reading
                pass

    def _fail_all(self, error: BaseException) -> None:
        self._deliver_all([(request_id, error) for request_id in list(self._streams)])


def _put_all(batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in batch:
        stream.put(item)
