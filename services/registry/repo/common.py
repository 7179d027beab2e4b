"""Helpers every repository shares: one unit of work per call, stale writes turned into 409s."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

import asyncpg
from sqlalchemy.exc import DBAPIError, DisconnectionError, IntegrityError, InterfaceError
from sqlalchemy.exc import OperationalError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker
from sqlalchemy.orm.exc import StaleDataError

from shoal.shared.db.base import Base
from shoal.shared.db.tables import InstanceRow
from shoal.shared.errors import Conflict, NotFound, Unavailable

RowT = TypeVar("RowT", bound=Base)


@contextlib.asynccontextmanager
async def unit_of_work(sessions: async_sessionmaker[AsyncSession],
                       what: str) -> AsyncIterator[AsyncSession]:
    """A session in a transaction; a lost optimistic race or a duplicate becomes Conflict.
    Inside a registry call's transaction (services/registry/outbox.py) it joins that one, so the
    change and its events commit together."""
    from shoal.services.registry.outbox import current_session

    try:
        outer = current_session()
        if outer is not None:
            yield outer
            await outer.flush()
            return
        async with sessions() as session, session.begin():
            yield session
    except StaleDataError:
        raise Conflict(f"{what} was changed by someone else; read it again and retry",
                       code="stale_version") from None
    except IntegrityError as exc:
        raise Conflict(f"{what} conflicts with an existing row: {exc.orig}",
                       code="duplicate") from None


_DOWN = (OSError, TimeoutError, DisconnectionError, OperationalError, InterfaceError,
         asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
         asyncpg.CannotConnectNowError, asyncpg.exceptions.OperatorInterventionError)


def database_down(exc: BaseException) -> BaseException | None:
    """The exception in `exc`'s chain that says Postgres is away (refused or lost connections,
    a server starting up or shutting down), or None when it is something else."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, _DOWN) or (isinstance(cause, DBAPIError)
                                        and cause.connection_invalidated):
            return cause
        cause = getattr(cause, "orig", None) or cause.__cause__ or cause.__context__
    return None


def database_unavailable(exc: BaseException) -> Unavailable | None:
    """Unavailable (503, Retry-After at the gateway) when `exc` means Postgres is away; None for
    anything else."""
    cause = database_down(exc)
    if cause is None:
        return None
    return Unavailable(f"the database is unavailable ({type(cause).__name__}); retry shortly",
                       code="database_unavailable")


async def get_or_404(session: AsyncSession, table: type[RowT], row_id: str, what: str) -> RowT:
    row = await session.get(table, row_id)
    if row is None:
        raise NotFound(f"{what} {row_id!r} not found")
    return row


def check_version(row_version: int, expected: int | None, what: str) -> None:
    """Refuse a write based on a stale read (before touching anything)."""
    if expected is not None and row_version != expected:
        raise Conflict(f"{what} is at version {row_version}, not {expected}: read it again and "
                       "retry", code="stale_version")


def workers_of(inst: InstanceRow) -> set[str]:
    """Every worker an instance runs on: its own and its pipeline stages' (subordinates)."""
    ids = {inst.worker_id} if inst.worker_id else set()
    for sub in (inst.placement or {}).get("subordinate_workers", []):
        ids.add(sub["worker_id"])
    return ids
