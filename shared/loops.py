"""The services' background loops: do something every few seconds until `stop` is set, and never
let one failure end the loop (a heartbeat, a load report, a liveness check, an event consumer, the
scheduler's and the worker supervisor's reconcile passes)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from shoal.shared.errors import ShoalError


async def wait_or_stop(stop: asyncio.Event, timeout: float) -> bool:
    """Wait up to `timeout` seconds for `stop`; True when it is set."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stop.wait(), timeout)
    return stop.is_set()


async def first_of(*aws: Awaitable[object], timeout: float | None = None) -> bool:
    """Wait for the first of `aws` to finish and cancel the rest; False on timeout."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        done, _ = await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()
    for task in done:
        task.result()  # re-raise a failure
    return bool(done)


class PassGuard:
    """Runs one pass of a loop and logs its failure instead of raising it: an `expected` one (a
    ShoalError: the registry or NATS is away) as one warning line, anything else with its
    traceback, once: the same error again on the next passes is one line, not another
    traceback. Cancellation is not caught."""

    def __init__(self, what: str, log: logging.Logger,
                 expected: tuple[type[BaseException], ...] = (ShoalError,)) -> None:
        self.what = what
        self.log = log
        self.expected = expected
        self.last: str | None = None
        """The last unexpected failure ("Type: message"), until a pass succeeds."""

    async def run(self, action: Callable[[], Awaitable[object]]) -> bool:
        """Await `action()`; True when it succeeded."""
        try:
            await action()
        except self.expected as exc:
            self.log.warning("%s failed: %s", self.what, getattr(exc, "message", None) or exc)
            return False
        except Exception as exc:  # noqa: BLE001 - one failure must not end the loop for good
            seen = f"{type(exc).__name__}: {exc}"
            if seen == self.last:
                self.log.error("%s failed again: %s", self.what, seen)
            else:
                self.log.exception("%s failed", self.what)
            self.last = seen
            return False
        self.last = None
        return True


async def run_every(interval: float, stop: asyncio.Event | None,
                    action: Callable[[], Awaitable[object]], what: str, log: logging.Logger,
                    expected: tuple[type[BaseException], ...] = (ShoalError,),
                    wake: asyncio.Event | None = None, *, first_wait: bool = False,
                    jitter: Callable[[], float] | None = None, debounce: float = 0.0) -> None:
    """Await `action()`, then wait `interval` seconds (or until `stop`, or `wake` when given),
    until `stop` is set (None: until cancelled); a failed pass is logged by a PassGuard and the
    loop goes on. A `wake` set during a pass runs the next one at once.

    first_wait: wait before the first pass too (the caller has just done one). jitter: a factor
    for each wait (replicas that started together drift apart). debounce: after a wake, wait this
    long more, so a burst of wakes makes one pass."""
    stop = stop if stop is not None else asyncio.Event()
    guard = PassGuard(what, log, expected)
    if first_wait and await _pause(stop, interval, wake, jitter, debounce):
        return
    while not stop.is_set():
        if wake is not None:
            wake.clear()
        await guard.run(action)
        if await _pause(stop, interval, wake, jitter, debounce):
            return


async def _pause(stop: asyncio.Event, interval: float, wake: asyncio.Event | None,
                 jitter: Callable[[], float] | None, debounce: float) -> bool:
    """run_every's wait between passes; True when `stop` is set."""
    timeout = interval * (jitter() if jitter is not None else 1.0)
    if wake is None:
        return await wait_or_stop(stop, timeout)
    await first_of(stop.wait(), wake.wait(), timeout=timeout)
    if wake.is_set() and debounce > 0 and not stop.is_set():
        return await wait_or_stop(stop, debounce)
    return stop.is_set()
