"""The election's pure helpers: database URLs for asyncpg, racing waits, the fence's bounds."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from shoal.services.scheduler.election import asyncpg_dsn, first_of
from shoal.shared.schemas.registry import LeaderFence


@pytest.mark.parametrize(("url", "dsn"), [
    ("postgresql+asyncpg://u:p@db:5432/shoal", "postgresql://u:p@db:5432/shoal"),
    ("postgres://u@db/shoal", "postgresql://u@db/shoal"),
    ("postgresql://postgres:@/postgres?host=/tmp/pg",) * 2,
])
def test_asyncpg_dsn(url: str, dsn: str) -> None:
    assert asyncpg_dsn(url) == dsn


async def test_first_of_cancels_the_rest() -> None:
    slow = asyncio.ensure_future(asyncio.sleep(60))
    assert await first_of(asyncio.sleep(0), slow) is True
    await asyncio.sleep(0)
    assert slow.cancelled()


async def test_first_of_times_out_and_cancels_everything() -> None:
    slow = asyncio.ensure_future(asyncio.sleep(60))
    assert await first_of(slow, timeout=0.01) is False
    await asyncio.sleep(0)
    assert slow.cancelled()


async def test_first_of_raises_what_finished_first() -> None:
    async def fail() -> None:
        raise LookupError("boom")

    with pytest.raises(LookupError):
        await first_of(fail(), asyncio.sleep(60))


@pytest.mark.parametrize("token", [0, 2**31])
def test_a_fence_token_is_a_positive_int4(token: int) -> None:
    with pytest.raises(ValidationError):
        LeaderFence(pid=1, token=token)
