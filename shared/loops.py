"""The services' background loops: do something every few seconds until `stop` is set, and never
let one failure end the loop (a heartbeat, a load report, a liveness check, an event consumer)."""

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


async def run_every(interval: float, stop: asyncio.Event, action: Callable[[], Awaitable[object]],
                    what: str, log: logging.Logger,
                    expected: tuple[type[BaseException], ...] = (ShoalError,)) -> None:
    """Await `action()`, then wait `interval` seconds (or until `stop`), until `stop` is set.

    An `expected` failure (a ShoalError: the registry or NATS is away) is logged as one warning
    line; anything else with its traceback. Either way the loop goes on."""
    while not stop.is_set():
        try:
            await action()
        except expected as exc:
            log.warning("%s failed: %s", what, getattr(exc, "message", None) or exc)
        except Exception:  # noqa: BLE001 - one failure must not end the loop for good
            log.exception("%s failed", what)
        if await wait_or_stop(stop, interval):
            return
