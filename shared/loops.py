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


async def run_every(interval: float, stop: asyncio.Event, action: Callable[[], Awaitable[object]],
                    what: str, log: logging.Logger,
                    expected: tuple[type[BaseException], ...] = (ShoalError,),
                    wake: asyncio.Event | None = None) -> None:
    """Await `action()`, then wait `interval` seconds (or until `stop`, or `wake` when given),
    until `stop` is set; a failed pass is logged by a PassGuard and the loop goes on. A `wake`
    set during a pass runs the next one at once."""
    guard = PassGuard(what, log, expected)
    while not stop.is_set():
        if wake is not None:
            wake.clear()
        await guard.run(action)
        if wake is None:
            if await wait_or_stop(stop, interval):
                return
            continue
        waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(wake.wait())]
        try:
            await asyncio.wait(waiters, timeout=interval, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()
