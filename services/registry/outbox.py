"""Lossless change events: the transactional outbox (docs/architecture.md "Events: an outbox").

Every registry write runs in one transaction (`transaction()`) that also inserts its change
events into `event_outbox`; the relay publishes those rows to JetStream in order and deletes
them. A registry that dies between the commit and the publish leaves its rows, and the next
relay (any registry's) publishes them; one that dies between the publish and the delete
publishes them again under the same Nats-Msg-Id, which the stream drops as a duplicate.

A row keeps the trace context of the call that wrote it (the registry's server span), and is
published with it, so a trace from a management call continues into the events' consumers
(`Bus.subscribe` / `Bus.consume` open a span under it), whenever the relay gets to the row.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator
from contextvars import ContextVar

from pydantic import BaseModel
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from shoal.services.registry.outage import OutageLog
from shoal.services.registry.repo.common import database_down
from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import encode
from shoal.shared.db.tables import OutboxRow
from shoal.shared.errors import Conflict
from shoal.shared.loops import run_every
from shoal.shared.telemetry import inject_headers

log = logging.getLogger(__name__)

_current: ContextVar[AsyncSession | None] = ContextVar("registry_transaction", default=None)
RELAY_BATCH = 256
RELAY_POLL_S = 0.5
"""How often the relay looks for rows it was not told about (left by a registry that died)."""


def current_session() -> AsyncSession | None:
    """The session of the transaction this task runs in (`transaction()`), if any."""
    return _current.get()


@contextlib.asynccontextmanager
async def transaction(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """One transaction for a whole registry call: the repositories' units of work join it, and
    the outbox rows of its events commit (or roll back) with it."""
    if _current.get() is not None:  # already inside one
        yield _current.get()  # type: ignore[misc]
        return
    try:
        async with sessions() as session, session.begin():
            token = _current.set(session)
            try:
                yield session
            finally:
                _current.reset(token)
    except StaleDataError:
        raise Conflict("changed by someone else meanwhile; read it again and retry",
                       code="stale_version") from None
    except IntegrityError as exc:
        raise Conflict(f"conflicts with an existing row: {exc.orig}", code="duplicate") from None


def add_event(subject: str, payload: BaseModel) -> None:
    """Queue an event in the current transaction (it is published once that commits)."""
    session = _current.get()
    if session is None:
        raise RuntimeError("events are written inside a registry transaction")
    session.add(OutboxRow(msg_id=uuid.uuid4().hex, subject=subject, payload=encode(payload),
                          headers=inject_headers() or None))


class OutboxRelay:
    """Publishes the outbox in order: at once when told (`kick`), and every RELAY_POLL_S for rows
    another (dead) registry left. Several registries may relay: rows are locked, SKIP LOCKED."""

    def __init__(self, sessions: async_sessionmaker[AsyncSession], bus: Bus,
                 outage: OutageLog) -> None:
        self.sessions = sessions
        self.bus = bus
        self.outage = outage
        self._kick = asyncio.Event()

    def kick(self) -> None:
        self._kick.set()

    async def relay_once(self) -> int:
        """Publish and delete one batch; how many rows it held."""
        async with self.sessions() as session, session.begin():
            rows = list(await session.scalars(
                select(OutboxRow).order_by(OutboxRow.seq).limit(RELAY_BATCH)
                .with_for_update(skip_locked=True)))
            for row in rows:
                await self.bus.js.publish(row.subject, row.payload,
                                          headers={**(row.headers or {}),
                                                   "Nats-Msg-Id": row.msg_id})
            if rows:
                await session.execute(delete(OutboxRow).where(
                    OutboxRow.seq.in_([row.seq for row in rows])))
        return len(rows)

    async def run(self, stop: asyncio.Event) -> None:
        """Relay every RELAY_POLL_S, or at once when a transaction kicks; once more after `stop`
        (what was written before it goes out)."""
        await run_every(RELAY_POLL_S, stop, self._relay_all, "event relay", log, wake=self._kick)
        await self._relay_all()

    async def _relay_all(self) -> None:
        try:
            while await self.relay_once() == RELAY_BATCH:
                pass
            self.outage.recovered()
        except Exception as exc:  # noqa: BLE001 - NATS or Postgres away: the rows wait
            if (cause := database_down(exc)) is not None:
                self.outage.failed("event relay", cause)
            else:
                log.warning("event relay: %s (the events wait in the outbox)",
                            getattr(exc, "message", None) or exc)
