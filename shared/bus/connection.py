"""What the bus's NATS connection reports: its errors, a lost and a regained connection (logged
unless the bus is closing, then the Bus's hooks run), and the servers' URLs without passwords."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from shoal.shared.bus.client import Bus

log = logging.getLogger(__name__)


def redacted(urls: str) -> str:
    from shoal.shared.embedded import redact_url

    return ",".join(redact_url(url.strip()) for url in urls.split(","))


def log_event(holder: list[Bus], text: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        if not (holder and holder[0].closing):
            log.warning(text)

    return callback


def on_disconnected(holder: list[Bus]) -> Callable[[], Awaitable[None]]:
    log_it = log_event(holder, "disconnected from NATS")

    async def callback() -> None:
        await log_it()
        if not holder or holder[0].closing:
            return
        for hook in holder[0].on_disconnect:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook must not stop the others
                log.exception("disconnect hook failed")

    return callback


def on_reconnected(holder: list[Bus]) -> Callable[[], Awaitable[None]]:
    log_it = log_event(holder, "reconnected to NATS")

    async def callback() -> None:
        await log_it()
        for hook in holder[0].on_reconnect if holder else ():
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook must not stop the others
                log.exception("reconnect hook failed")

    return callback


async def log_error(exc: Exception) -> None:
    log.warning("NATS error: %s", exc)
