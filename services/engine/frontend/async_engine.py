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
from pathlib import Path
from typing import Any

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.engine_core import EngineCore
from shoal.services.engine.frontend.core_builder import build_core
from shoal.services.engine.frontend.output_stream import OutputCollector, RequestStream, put_all
from shoal.services.engine.core.request_state import EngineRequest, Resumed
from shoal.services.engine.core.request_output import EngineStats, RequestOutput, RequestOutputKind
from shoal.services.engine.lora_request import LoRARequest
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest, ShoalError, Unavailable

log = logging.getLogger(__name__)
HANDOVER_S = 0.002
"""The longest the loop waits for an idle engine thread to take a request (~0.1-0.3 ms measured)."""


class AsyncEngine:
    """An EngineCore on its own thread. Given a config, the thread builds the core itself: torch
    ran a step 1.5-1.8x slower (SmolLM2 on 2 CPU cores, batches of 32) on a thread other than
    the one that loaded the model, so loading and stepping share one thread."""

    def __init__(self, config: EngineConfig | None = None, *, core: EngineCore | None = None,
                 model_dir: Path | None = None) -> None:
        """model_dir: the model already prepared by the caller (see build_core)."""
        if core is None and config is None:
            raise ValueError("AsyncEngine needs an EngineConfig or an EngineCore")
        self._lock = threading.Lock()
        self._commands: list[EngineRequest | str] = []  # a request to add, or an id to abort
        self._wakeup = threading.Event()
        self._idle = False
        """The engine thread has nothing to run: it waits for work, or is about to (delivering
        the outputs of a step that left nothing running). Set and read under _lock."""
        self._taken = threading.Event()
        """Set when the engine thread has taken the queued commands (see _send)."""
        self._streams: dict[str, OutputCollector] = {}
        self._error: BaseException | None = None
        self._stopping = False
        self.core: EngineCore
        self._stats: EngineStats
        built: list[EngineCore | BaseException] = [core] if core is not None else []
        loaded = threading.Event()

        def build_then_run() -> None:
            if not built:
                try:
                    built.append(build_core(config, model_dir=model_dir))  # type: ignore[arg-type]
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
    def error(self) -> BaseException | None:
        """What stopped the step loop (None while it runs): the server reports it and exits."""
        return self._error

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    def stats(self) -> EngineStats:
        """The snapshot taken after the latest step (cheap; never waits for the engine)."""
        return self._stats

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, prompt: str | None = None,
                    output_kind: RequestOutputKind = RequestOutputKind.DELTA,
                    lora_request: LoRARequest | None = None,
                    resume: Resumed | None = None) -> None:
        """Check a request on the caller's thread (InvalidRequest at once if it could never run)
        and queue it for the engine thread, which adds it unchecked. Its outputs go to the
        stream opened by open(); most callers want open() or generate()."""
        self._check_alive()
        self._send(self.core.process(request_id, prompt_token_ids, params, arrival_time,
                                     prompt=prompt, output_kind=output_kind,
                                     lora_request=lora_request, resume=resume))

    def open(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
             arrival_time: float | None = None, *, prompt: str | None = None,
             output_kind: RequestOutputKind = RequestOutputKind.DELTA,
             lora_request: LoRARequest | None = None,
             resume: Resumed | None = None) -> RequestStream:
        """Check and queue a request now (InvalidRequest or Unavailable at once, before anything
        is sent to a client) and return the stream of its outputs. Iterate it to the end or
        close() it: closing early aborts the request."""
        if request_id in self._streams:
            raise InvalidRequest(f"request id {request_id!r} is already in use", param="request_id")
        stream = OutputCollector(asyncio.get_running_loop(), output_kind)
        self._streams[request_id] = stream  # before the add: the engine thread may answer at once
        try:
            self.add_request(request_id, prompt_token_ids, params, arrival_time, prompt=prompt,
                             output_kind=output_kind, lora_request=lora_request, resume=resume)
        except BaseException:
            del self._streams[request_id]
            raise
        return RequestStream(request_id, stream, on_done=lambda: self._forget(request_id, stream),
                             abort=lambda: self.abort(request_id))

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                       arrival_time: float | None = None, *, prompt: str | None = None,
                       output_kind: RequestOutputKind = RequestOutputKind.DELTA
                       ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas by default) until it finishes. Stopping the
        iteration early, or cancelling the task, aborts the request."""
        stream = self.open(request_id, prompt_token_ids, params, arrival_time, prompt=prompt,
                           output_kind=output_kind)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

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
        close = getattr(getattr(self, "core", None), "runner", None)
        if not self._thread.is_alive() and hasattr(close, "close"):
            close.close()  # a tensor / pipeline parallel engine's other ranks

    def _forget(self, request_id: str, stream: OutputCollector) -> None:
        if self._streams.get(request_id) is stream:
            del self._streams[request_id]

    def _send(self, command: EngineRequest | str) -> None:
        """Queue a command. To an idle engine thread, also hand the GIL: the caller (the event
        loop) blocks until the thread has taken the command, at most HANDOVER_S, so the step
        starts before the loop goes on with its own Python (publishing the accepted chunk, ~0.7
        ms that the woken thread otherwise waited for; docs/figures.md, issue 31 item 6). Idle
        counts from the end of a step that left nothing running, not only once the thread
        waits: before, a request sent meanwhile (during the clean-up step a 1-token request
        left, say) went without."""
        with self._lock:
            self._commands.append(command)
            idle = self._idle
            if idle:
                self._taken.clear()
        self._wakeup.set()
        if idle:
            self._taken.wait(HANDOVER_S)

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
                if not self.core.has_requests():  # finished sequences' runner state is
                    self._mark_idle()  # dropped by the next step, not by a step of its own
                    self._wakeup.wait()
                    self._wakeup.clear()
                    continue
                outputs = self.core.step()
                self._stats = self.core.stats()  # before delivery: a reader sees them together
                if not self.core.has_requests():  # before delivery: the reader's next request
                    self._mark_idle()  # gets the hand-off (see _send)
                self._deliver_all([(output.request_id, output.error or output)
                                   for output in outputs])
        except BaseException as exc:  # fail every stream instead of leaving it hanging
            log.exception("engine step loop failed")
            self._error = exc
            error = Unavailable(f"the engine failed: {exc!r}")
            error.__cause__ = exc
            self._fail_all(error)

    def _mark_idle(self) -> None:
        """Nothing left to run: a request sent from now on waits for this thread to take it."""
        with self._lock:
            self._idle = not self._commands

    def _apply_commands(self) -> None:
        with self._lock:
            commands, self._commands = self._commands, []
            self._idle = False
        self._taken.set()
        items: list[tuple[str, RequestOutput | BaseException]] = []
        for command in commands:
            if isinstance(command, str):
                output = self.core.abort(command)
                if output is not None:
                    items.append((command, output))
                continue
            try:
                self.core.add(command)
            except ShoalError as exc:  # e.g. a duplicate id that slipped past open()
                items.append((command.request_id, exc))
        self._stats = self.core.stats()
        self._deliver_all(items)

    def _deliver_all(self, items: list[tuple[str, RequestOutput | BaseException]]) -> None:
        """One wake-up per event loop for a whole step (not one per request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[OutputCollector, Any]]] = {}
        for request_id, item in items:
            stream = self._streams.get(request_id)
            if stream is not None and not stream.loop.is_closed():
                by_loop.setdefault(stream.loop, []).append((stream, item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, batch)
            except RuntimeError:  # the loop closed meanwhile: nobody is reading
                pass

    def _fail_all(self, error: BaseException) -> None:
        self._deliver_all([(request_id, error) for request_id in list(self._streams)])
