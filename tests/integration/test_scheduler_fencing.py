"""The election adapter and the registry's write fence on a real Postgres (and the real registry
over NATS): a stale leader's writes are refused, a new leader waits for fenced writes in flight,
and standbys outlast their lock_timeout waits."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path

import asyncpg
import pytest
from tests.integration.sched_helpers import (
    delete_models, llama_config, start_worker, stop_workers, wait_for,
)

from shoal.services.scheduler.election import PostgresElection, asyncpg_dsn
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.db.leader_lock import BARRIER_KEY, LOCK_SPACE, NOT_LEADER
from shoal.shared.errors import Conflict
from shoal.shared.schemas.registry import (
    InstanceCreate, InstanceDelete, InstanceTransition, LeaderFence, ModelCreate, Placement,
)
from shoal.shared.states import InstanceState

pytestmark = pytest.mark.integration


class Campaign:
    """One PostgresElection campaigning in this process until stopped."""

    def __init__(self, settings: Settings, name: str, interval: float) -> None:
        assert settings.database_url
        self.election = PostgresElection(settings.database_url, name, interval)
        self.resign = asyncio.Event()
        self.task = asyncio.create_task(self.election.run(self.resign))

    async def stop(self) -> None:
        self.resign.set()
        await asyncio.wait_for(self.task, 10)

    async def fence(self, other_than: LeaderFence | None = None) -> LeaderFence:
        """The fence of this campaign's term, once it leads (in a term other than the one
        `other_than` names)."""
        async def current() -> LeaderFence | None:
            term = self.election.term
            return term.fence if term is not None and term.fence != other_than else None

        return await wait_for(current, 10, f"{self.election.identity} to lead", poll=0.02)


async def _value(value: object) -> object:
    return value


async def refused(write: Callable[[], Awaitable[object]]) -> None:
    with pytest.raises(Conflict) as caught:
        await write()
    assert caught.value.code == NOT_LEADER, caught.value.message


async def terminate_backend(settings: Settings, pid: int) -> None:
    admin = await asyncpg.connect(asyncpg_dsn(settings.database_url or ""))
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()


async def test_a_stale_leader_cannot_commit(client: RegistryClient, settings: Settings,
                                            tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    workers = [await start_worker(settings, f"{tag}-w1", "1xH100-80GB", {"suite": tag})]
    model = await client.create_model(ModelCreate(
        name=f"fence-{tag}", source=llama_config(tmp_path / "m", 2048, 16, 8, 16), replicas=0))
    (worker,) = [w for w in await client.list_workers() if w.name == f"{tag}-w1"]
    a = Campaign(settings, f"a-{tag}", 0.1)
    b: Campaign | None = None
    try:
        old = await a.fence()
        inst = await client.create_instance(InstanceCreate(model_id=model.id, fence=old))
        forged = LeaderFence(pid=old.pid, token=old.token % (2**31 - 2) + 1)
        await refused(lambda: client.create_instance(InstanceCreate(model_id=model.id,
                                                                    fence=forged)))

        # the leader's connection dies: its fence is refused at once, even when it leads again
        await terminate_backend(settings, old.pid)
        again = await a.fence(other_than=old)
        schedule = InstanceTransition(id=inst.id, version=inst.version,
                                      state=InstanceState.SCHEDULED,
                                      placement=Placement(worker_id=worker.id, gpu_indexes=[0]))
        await refused(lambda: client.transition_instance(schedule.model_copy(
            update={"fence": old})))

        # another replica takes over: neither earlier fence can write, the new one can
        b = Campaign(settings, f"b-{tag}", 0.1)
        await wait_for(lambda: _value(b.election.leader == f"a-{tag}"), 10, "b to stand by")
        await terminate_backend(settings, again.pid)
        new = await b.fence()
        for stale in (old, again):
            await refused(lambda f=stale: client.transition_instance(schedule.model_copy(
                update={"fence": f})))
            await refused(lambda f=stale: client.delete_instance(InstanceDelete(
                id=inst.id, version=inst.version, fence=f)))
            await refused(lambda f=stale: client.create_instance(InstanceCreate(
                model_id=model.id, fence=f)))
        unchanged = await client.get_instance(inst.id)
        assert (unchanged.state, unchanged.version) == (InstanceState.PENDING, inst.version)
        placed = await client.transition_instance(schedule.model_copy(update={"fence": new}))
        assert placed.state is InstanceState.SCHEDULED and placed.worker_id == worker.id
    finally:
        for campaign in (a, b):
            if campaign is not None:
                await campaign.stop()
        await stop_workers(workers)
        await delete_models(client, tag)


async def test_a_new_leader_waits_for_fenced_writes_in_flight(settings: Settings) -> None:
    """A registry transaction that passed the fence check holds the barrier shared: the next
    leader may not read (nor place) until it has committed."""
    tag = uuid.uuid4().hex[:6]
    dsn = asyncpg_dsn(settings.database_url or "")
    a = Campaign(settings, f"a-{tag}", 1.0)  # lock_timeout 5 s: longer than this test's steps
    b: Campaign | None = None
    writer = await asyncpg.connect(dsn)
    try:
        old = await a.fence()
        b = Campaign(settings, f"b-{tag}", 1.0)
        await wait_for(lambda: _value(b.election.leader == f"a-{tag}"), 10, "b to stand by")
        in_flight = writer.transaction()
        await in_flight.start()
        await writer.execute("SELECT pg_advisory_xact_lock_shared($1, $2)", LOCK_SPACE,
                             BARRIER_KEY)
        await terminate_backend(settings, old.pid)

        async def b_waits_on_the_barrier() -> bool:
            return bool(await writer.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND classid = $1 AND objid = $2 AND objsubid = 2", LOCK_SPACE, BARRIER_KEY))

        await wait_for(b_waits_on_the_barrier, 10, "b to wait on the barrier", poll=0.02)
        assert not b.election.is_leader
        await in_flight.commit()
        assert await b.fence() != old
    finally:
        await writer.close()
        for campaign in (a, b):
            if campaign is not None:
                await campaign.stop()


async def test_a_fenced_write_waits_while_a_new_leader_takes_the_barrier(
        client: RegistryClient, settings: Settings, tmp_path: Path) -> None:
    """The registry's side of the barrier: a fenced write takes it shared before its check."""
    tag = uuid.uuid4().hex[:6]
    model = await client.create_model(ModelCreate(
        name=f"barrier-{tag}", source=llama_config(tmp_path / "m", 2048, 16, 8, 16), replicas=0))
    a = Campaign(settings, f"a-{tag}", 0.1)
    barrier = await asyncpg.connect(asyncpg_dsn(settings.database_url or ""))
    try:
        fence = await a.fence()
        taken = barrier.transaction()
        await taken.start()
        await barrier.execute("SELECT pg_advisory_xact_lock($1, $2)", LOCK_SPACE, BARRIER_KEY)
        write = asyncio.create_task(client.create_instance(InstanceCreate(model_id=model.id,
                                                                          fence=fence)))

        async def write_waits() -> bool:
            return bool(await barrier.fetchval(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"
                " AND mode = 'ShareLock' AND classid = $1 AND objid = $2", LOCK_SPACE,
                BARRIER_KEY))

        await wait_for(write_waits, 5, "the fenced write to wait on the barrier", poll=0.02)
        assert not write.done()
        await taken.commit()
        assert (await write).model_id == model.id
    finally:
        await barrier.close()
        await a.stop()
        await delete_models(client, tag)


async def test_a_standby_outlasts_its_lock_timeouts(settings: Settings) -> None:
    tag = uuid.uuid4().hex[:6]
    a = Campaign(settings, f"a-{tag}", 0.1)  # lock_timeout 0.5 s
    b: Campaign | None = None
    try:
        await a.fence()
        b = Campaign(settings, f"b-{tag}", 0.1)
        await wait_for(lambda: _value(b.election.leader == f"a-{tag}"), 10, "b to stand by")
        await asyncio.sleep(1.6)  # three lock_timeout waits
        assert not b.election.is_leader and b.election.leader == f"a-{tag}"
        assert not b.task.done()
        await a.stop()
        await b.fence()
    finally:
        with contextlib.suppress(Exception):
            await a.stop()
        if b is not None:
            await b.stop()
