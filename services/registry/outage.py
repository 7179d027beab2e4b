"""A Postgres outage in the registry's log: a few lines, not a traceback per heartbeat.

While the database is away every heartbeat, liveness check, relay poll and bus request fails
the same way; logging each (SQLAlchemy + asyncpg tracebacks run to ~150 lines) buries the rest
of the log. OutageLog writes one warning line per failure kind (the exception's class) at most
every `every_s` seconds, with how many failures it left out, and one line when the database
answers again. Pure logic (the clock is injected), so the rate limit is unit-tested.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

OUTAGE_LOG_EVERY_S = 30.0
"""The least time between two warnings of one failure kind during a database outage."""


@dataclass(slots=True)
class _Kind:
    last_logged: float
    left_out: int = 0


class OutageLog:
    def __init__(self, log: logging.Logger, every_s: float = OUTAGE_LOG_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.every_s, self.clock = log, every_s, clock
        self._kinds: dict[str, _Kind] = {}
        self._since: float | None = None
        self._failures = 0

    @property
    def down(self) -> bool:
        return self._since is not None

    def failed(self, what: str, cause: BaseException) -> bool:
        """`what` (a heartbeat, `models.list`) failed because of `cause`; True when logged."""
        now = self.clock()
        if self._since is None:
            self._since = now
        self._failures += 1
        kind = type(cause).__name__
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.last_logged < self.every_s:
            seen.left_out += 1
            return False
        left_out = seen.left_out if seen is not None else 0
        self._kinds[kind] = _Kind(last_logged=now)
        message = " ".join(str(cause).split())[:300] or "no message"
        more = f"; {left_out} more like it since the last report" if left_out else ""
        self.log.warning("the database is unavailable: %s: %s (%s%s)", kind, message, what, more)
        return True

    def recovered(self) -> bool:
        """A database call succeeded; True when that ends an outage (logged once)."""
        if self._since is None:
            return False
        self.log.info("the database is back after %.0f s (%d failed calls)",
                         self.clock() - self._since, self._failures)
        self._since, self._failures = None, 0
        self._kinds.clear()
        return True
