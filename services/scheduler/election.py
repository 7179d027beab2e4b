"""Leader election of the scheduler replicas on a Postgres session-level advisory lock.

The leader holds the lock on a dedicated connection, so the server frees it the moment that
connection ends: a clean stop, a killed process (the kernel closes its socket), a terminated
backend. Standbys block in pg_advisory_lock (bounded by lock_timeout, then they re-read who
leads), so the first in line takes over as soon as the lock is free, with no lease to expire.
Each term gets a LeaderFence that rides on the leader's registry writes (leader_lock.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Protocol

import asyncpg

from shoal.shared.loops import first_of
from shoal.shared.db.leader_lock import BARRIER_KEY, LEADER_KEY, LOCK_SPACE, TOKEN_SPACE
from shoal.shared.schemas.common import utcnow
from shoal.shared.schemas.registry import LeaderFence

log = logging.getLogger(__name__)

APP_PREFIX = "shoal-scheduler:"
"""application_name of a lock connection: how standbys learn the leader's name."""
STANDBY_WAIT_INTERVALS = 5
"""A standby's wait on the lock lasts this many election intervals, then it re-reads who leads."""
KEEPALIVES = {"tcp_keepalives_idle": "5", "tcp_keepalives_interval": "2",
              "tcp_keepalives_count": "3"}
"""Server-side TCP keepalives on lock connections: the lock of a leader whose host vanished
without closing its socket is freed after ~11 s of silence, not the kernel's two hours."""
CONNECTION_ERRORS = (OSError, asyncio.TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)

_LOCK = "SELECT pg_advisory_lock($1, $2)"
_TRY_LOCK = "SELECT pg_try_advisory_lock($1, $2)"
_BARRIER = "SELECT pg_advisory_xact_lock($1, $2)"
_HOLDER = """
    SELECT l.pid, a.application_name FROM pg_locks l LEFT JOIN pg_stat_activity a USING (pid)
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 2
      AND l.classid = $1 AND l.objid = $2
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
"""


@dataclass(slots=True)
class Term:
    """One spell as leader: the fence its writes carry, and an event set when it ends."""

    fence: LeaderFence
    started_at: datetime
    ended: asyncio.Event = field(default_factory=asyncio.Event)


class Leadership(Protocol):
    """What the service needs from an election."""

    async def next_term(self, stop: asyncio.Event) -> Term | None:
        """The current term once this replica leads; None if `stop` is set first."""
        ...


def default_identity() -> str:
    """<hostname>-<pid>: a pod name on Kubernetes, unique among processes on one machine."""
    return f"{socket.gethostname()}-{os.getpid()}"


def asyncpg_dsn(database_url: str) -> str:
    """SHOAL_DATABASE_URL as a plain libpq URL for a bare asyncpg connection."""
    for prefix in ("postgresql+asyncpg://", "postgres://"):
        if database_url.startswith(prefix):
            return "postgresql://" + database_url[len(prefix):]
    return database_url


class PostgresElection:
    """Campaigns for the scheduler lock until resigned; `term` is set while this replica leads."""

    def __init__(self, database_url: str, identity: str, interval: float = 1.0) -> None:
        self.dsn = asyncpg_dsn(database_url)
        self.identity = identity
        self.interval = interval
        self.query_timeout = interval * (STANDBY_WAIT_INTERVALS + 2)
        """Client-side bound on any query of the lock connection (a silent server raises
        TimeoutError and the connection is replaced); the lock wait's lock_timeout is shorter."""
        self.term: Term | None = None
        self.leader: str | None = None
        """The leading replica as last seen (this one's identity while it leads)."""
        self._elected = asyncio.Event()

    @property
    def is_leader(self) -> bool:
        return self.term is not None

    async def next_term(self, stop: asyncio.Event) -> Term | None:
        while not stop.is_set():
            if self.term is not None:
                return self.term
            await first_of(self._elected.wait(), stop.wait())
        return None

    async def run(self, resign: asyncio.Event) -> None:
        """Campaign, lead, and campaign again after a lost connection, until `resign` is set;
        then the lock is released at once (closing its connection), so a standby takes over."""
        while not resign.is_set():
            try:
                conn = await asyncpg.connect(self.dsn, timeout=10, server_settings=self._session())
            except CONNECTION_ERRORS as exc:
                log.warning("scheduler %s cannot reach Postgres to campaign for leader (%s)",
                            self.identity, exc)
                await first_of(resign.wait(), timeout=self.interval)
                continue
            reason = "its lock connection failed"
            try:
                reason = await self._campaign(conn, resign)
            except CONNECTION_ERRORS as exc:
                reason = f"its lock connection failed ({type(exc).__name__}: {exc})"
            finally:
                self._end_term(reason)
                await _close(conn)
            if not resign.is_set():
                await first_of(resign.wait(), timeout=self.interval)

    def _session(self) -> dict[str, str]:
        wait_ms = int(self.interval * STANDBY_WAIT_INTERVALS * 1000)
        return {"application_name": (APP_PREFIX + self.identity)[:63],
                "lock_timeout": str(wait_ms), **KEEPALIVES}

    async def _campaign(self, conn: asyncpg.Connection, resign: asyncio.Event) -> str:
        """Wait for the lock, open a term, hold it; the reason the term (or the wait) ended."""
        closed = asyncio.Event()
        conn.add_termination_listener(lambda _conn: closed.set())
        started = time.monotonic()
        while True:
            if resign.is_set():
                return "it is stopping"
            if closed.is_set():
                return "its lock connection closed"
            row = await conn.fetchrow(_HOLDER, LOCK_SPACE, LEADER_KEY, timeout=self.query_timeout)
            self._see(None if row is None else
                      (row["application_name"] or "").removeprefix(APP_PREFIX)
                      or f"backend {row['pid']}")
            try:
                lock = conn.execute(_LOCK, LOCK_SPACE, LEADER_KEY, timeout=self.query_timeout)
                if await first_of(lock, resign.wait(), closed.wait()) and not (
                        resign.is_set() or closed.is_set()):
                    break
            except asyncpg.LockNotAvailableError:
                continue  # lock_timeout: look who leads now, then wait again
        token = await self._take_token(conn, self.query_timeout)
        await conn.execute(_BARRIER, LOCK_SPACE, BARRIER_KEY, timeout=self.query_timeout)
        self._start_term(LeaderFence(pid=conn.get_server_pid(), token=token),
                         time.monotonic() - started)
        return await self._hold(conn, resign, closed)

    @staticmethod
    async def _take_token(conn: asyncpg.Connection, timeout: float) -> int:
        """A random token, locked beside the leader lock for the term (retried if taken)."""
        while True:
            token = secrets.randbelow(2**31 - 1) + 1
            if await conn.fetchval(_TRY_LOCK, TOKEN_SPACE, token, timeout=timeout):
                return token

    async def _hold(self, conn: asyncpg.Connection, resign: asyncio.Event,
                    closed: asyncio.Event) -> str:
        """Lead until resigned or the connection is lost: closed (noticed at once) or silent
        (a check unanswered for two intervals raises TimeoutError)."""
        while not await first_of(resign.wait(), closed.wait(), timeout=self.interval):
            await asyncio.wait_for(conn.fetchval("SELECT 1"), 2 * self.interval)
        return "it is stopping" if resign.is_set() else "its lock connection closed"

    def _see(self, leader: str | None) -> None:
        if leader != self.leader:
            self.leader = leader
            log.info("scheduler %s stands by; the leader is %s", self.identity,
                     leader or "none yet")

    def _start_term(self, fence: LeaderFence, waited: float) -> None:
        self.term = Term(fence=fence, started_at=utcnow())
        self.leader = self.identity
        self._elected.set()
        log.info("scheduler %s is now the leader (lock backend %d, after %.2fs in line)",
                 self.identity, fence.pid, waited)

    def _end_term(self, reason: str) -> None:
        self.leader = None
        if self.term is None:
            return
        term, self.term = self.term, None
        self._elected.clear()
        term.ended.set()
        level = logging.INFO if reason == "it is stopping" else logging.WARNING
        log.log(level, "scheduler %s is no longer the leader: %s", self.identity, reason)


async def _close(conn: asyncpg.Connection) -> None:
    """Close politely (the server frees the locks at once); abort if the server does not answer."""
    try:
        await asyncio.wait_for(conn.close(), 2)
    except Exception:  # noqa: BLE001 - the connection is gone either way
        with contextlib.suppress(Exception):
            conn.terminate()
