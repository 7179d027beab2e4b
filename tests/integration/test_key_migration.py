"""Key scopes on an existing database (real Postgres, a database of its own): a key made before
scopes existed is an admin key after the migration, and a key created without a scope is admin
only while no usable admin key exists (the bootstrap key), inference after that."""

from __future__ import annotations

import asyncio

import pytest
from alembic import command
from sqlalchemy import Connection, text

from shoal.services.registry.repo.api_keys import ApiKeyRepo, hash_secret, new_secret
from shoal.shared.db.session import (
    alembic_config, make_engine, make_session_factory, run_migrations
)
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyScope, ApiKeyVerify, ById
from tests.conftest import _fresh_database

pytestmark = pytest.mark.integration


def _upgrade_to_0001(connection: Connection) -> None:
    cfg = alembic_config()
    cfg.attributes["connection"] = connection
    command.upgrade(cfg, "0001")


async def test_old_keys_become_admin_and_the_first_key_bootstraps(servers) -> None:
    url = await asyncio.to_thread(_fresh_database, servers.database_url)
    engine = make_engine(url)
    try:
        secret = new_secret()
        async with engine.begin() as conn:  # the schema and a key as before this change
            await conn.run_sync(_upgrade_to_0001)
            await conn.execute(text(
                "INSERT INTO api_keys (id, version, name, prefix, secret_hash) "
                "VALUES ('oldkey', 1, 'old', 'sk-shoal-xxxx', :h)"), {"h": hash_secret(secret)})
        await run_migrations(engine)  # what the registry does on start
        keys = ApiKeyRepo(make_session_factory(engine))
        old = await keys.verify(ApiKeyVerify(secret=secret))
        assert old.valid and old.scope is ApiKeyScope.ADMIN and not old.has_limits
        assert (await keys.create(ApiKeyCreate(name="b"))).scope is ApiKeyScope.INFERENCE
        await keys.revoke(ById(id="oldkey"))  # no usable admin key left
        first = await keys.create(ApiKeyCreate(name="c"))
        second = await keys.create(ApiKeyCreate(name="d"))
        assert (first.scope, second.scope) == (ApiKeyScope.ADMIN, ApiKeyScope.INFERENCE)
        explicit = await keys.create(ApiKeyCreate(name="e", scope=ApiKeyScope.ADMIN))
        assert explicit.scope is ApiKeyScope.ADMIN
    finally:
        await engine.dispose()


def _upgrade_to(revision: str):  # noqa: ANN202 - a run_sync callable
    def upgrade(connection: Connection) -> None:
        cfg = alembic_config()
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)
    return upgrade


async def test_duplicate_key_names_are_renamed_and_then_refused(servers) -> None:
    """Issue 24: names could repeat (the README's quick start made `my-app` twice) and a name
    meant the first match. The migration keeps a name on its oldest key not revoked and renames
    the later ones NAME-2, NAME-3, ... (the first free); revoked keys keep theirs; from then on
    a second key not revoked with one name is refused by the database itself."""
    from sqlalchemy.exc import IntegrityError

    url = await asyncio.to_thread(_fresh_database, servers.database_url)
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:  # the schema and keys as before this change
            await conn.run_sync(_upgrade_to("0006_usage_batches"))
            for i, (key_id, name, revoked) in enumerate((
                    ("k1", "my-app", False), ("k2", "my-app", False), ("k3", "my-app", True),
                    ("k4", "my-app", False), ("k5", "my-app-2", False), ("k6", "x" * 63, False),
                    ("k7", "x" * 63, False))):
                await conn.execute(text(
                    "INSERT INTO api_keys (id, version, name, prefix, secret_hash, created_at, "
                    "revoked_at) VALUES (:id, 1, :name, 'sk-shoal-xxxx', :h, "
                    "now() - make_interval(secs => :age), "
                    "CASE WHEN :revoked THEN now() ELSE NULL END)"),
                    {"id": key_id, "name": name, "h": hash_secret(new_secret()), "age": 100 - i,
                     "revoked": revoked})
        await run_migrations(engine)
        async with engine.begin() as conn:
            names = dict((await conn.execute(text("SELECT id, name FROM api_keys"))).all())
        assert names == {"k1": "my-app", "k2": "my-app-3", "k3": "my-app", "k4": "my-app-4",
                         "k5": "my-app-2", "k6": "x" * 63, "k7": "x" * 61 + "-2"}
        with pytest.raises(IntegrityError):
            async with engine.begin() as conn:
                await conn.execute(text(
                    "INSERT INTO api_keys (id, version, name, prefix, secret_hash) "
                    "VALUES ('k8', 1, 'my-app', 'sk-shoal-xxxx', 'h8')"))
    finally:
        await engine.dispose()


async def test_limits_beyond_the_counters_are_lowered_to_the_largest(servers) -> None:
    """Issue 24: a limit of 1e20 rpm was stored, and every request of its key was then a 503
    (the counters are BIGINTs). Limits are now bounded (MAX_LIMIT); the migration lowers one
    stored before to the bound, so the key works, and leaves the others as they were."""
    from shoal.services.registry.repo.quota import QuotaRepo
    from shoal.shared.schemas.registry import MAX_LIMIT, QuotaAcquire

    url = await asyncio.to_thread(_fresh_database, servers.database_url)
    engine = make_engine(url)
    try:
        async with engine.begin() as conn:  # the schema and keys as before this change
            await conn.run_sync(_upgrade_to("0007_key_names_unique"))
            for key_id, limits in (
                    ("big", '[{"rpm": 100000000000000000000, "model": "m"}, {"tpm": 5}]'),
                    ("fine", '[{"rpm": 60}]')):
                await conn.execute(text(
                    "INSERT INTO api_keys (id, version, name, prefix, secret_hash, limits) "
                    "VALUES (:id, 1, :id, 'sk-shoal-xxxx', :h, CAST(:limits AS json))"),
                    {"id": key_id, "h": hash_secret(new_secret()), "limits": limits})
        await run_migrations(engine)
        keys = ApiKeyRepo(make_session_factory(engine))
        assert [x.model_dump(exclude_none=True) for x in (await keys.get(ById(id="big"))).limits
                ] == [{"model": "m", "rpm": MAX_LIMIT}, {"tpm": 5}]
        assert (await keys.get(ById(id="fine"))).limits[0].rpm == 60
        grant = await QuotaRepo(make_session_factory(engine)).acquire(
            QuotaAcquire(key_id="big", model="m"))
        assert grant.allowed and grant.limit_requests == MAX_LIMIT
    finally:
        await engine.dispose()
