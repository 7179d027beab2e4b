"""Scheduler replicas over real NATS + Postgres: one leader places, standbys take over when it
stops, is killed or loses its connection, and a leader that lost the lock cannot write."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import asyncpg
import pytest
from tests.integration.conftest import running_service
from tests.integration.sched_helpers import (
    all_scheduled, delete_models, llama_config, start_worker, stop_workers, wait_for,
)

from shoal.services.scheduler.election import asyncpg_dsn
from shoal.services.scheduler.replica import SchedulerReplica
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.common import Empty
from shoal.shared.schemas.registry import InstancePublic, ModelCreate
from shoal.shared.schemas.scheduler import SchedulerStatus

pytestmark = pytest.mark.integration


class Replica:
    """A whole scheduler replica (what `shoal scheduler` runs) in this process."""

    def __init__(self, settings: Settings, name: str) -> None:
        self.settings = settings.model_copy(update={
            "scheduler_name": name, "scheduler_interval": 0.5, "scheduler_election_interval": 0.5})
        self.replica = SchedulerReplica(self.settings)
        self._cm: contextlib.AbstractAsyncContextManager[asyncio.Task[None]] | None = None

    @property
    def name(self) -> str:
        return self.replica.identity

    @property
    def is_leader(self) -> bool:
        return self.replica.election.is_leader

    @property
    def passes(self) -> int:
        assert self.replica.service is not None
        return self.replica.service.passes

    async def start(self) -> Replica:
        self._cm = running_service(lambda _s, stop, ready: self.replica.serve(stop, ready),
                                   self.settings)
        await self._cm.__aenter__()
        return self

    async def stop(self) -> None:
        if self._cm is not None:
            cm, self._cm = self._cm, None
            await cm.__aexit__(None, None, None)


async def the_leader(*replicas: Replica) -> Replica:
    async def one() -> Replica | None:
        leaders = [r for r in replicas if r.is_leader]
        assert len(leaders) <= 1, [r.name for r in leaders]
        return leaders[0] if leaders else None

    return await wait_for(one, 15, "a leader", poll=0.02)


async def deploy(client: RegistryClient, name: str, source: str, replicas: int,
                 labels: dict[str, str]) -> list[InstancePublic]:
    model = await client.create_model(ModelCreate(name=name, source=source, replicas=replicas,
                                                  worker_selector=labels, device="gpu"))
    return await wait_for(lambda: all_scheduled(client, model.id, replicas), 20,
                          f"{name} SCHEDULED", poll=0.02)


async def holds(value: object) -> object:
    return value


async def ping_ids(bus: Bus, expected: int) -> set[str]:
    """The ids of the scheduler replicas that answer $SRV.PING (standbys included)."""
    replies: asyncio.Queue[bytes] = asyncio.Queue()

    async def on_reply(msg) -> None:  # noqa: ANN001
        await replies.put(msg.data)

    inbox = bus.nc.new_inbox()
    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    ids: set[str] = set()
    try:
        await bus.nc.publish(f"$SRV.PING.{bus.subjects.scheduler_service}", b"", reply=inbox)
        with contextlib.suppress(asyncio.TimeoutError):
            while len(ids) < expected:
                ids.add(json.loads(await asyncio.wait_for(replies.get(), 5))["id"])
    finally:
        await sub.unsubscribe()
    return ids


@contextlib.asynccontextmanager
async def fleet(client: RegistryClient, settings: Settings, tag: str):  # noqa: ANN201
    """Two simulated workers with 2 GPUs each, labelled for this test; models cleaned up."""
    labels = {"suite": tag}
    workers = [await start_worker(settings, f"{tag}-w{i}", "2xH100-80GB", labels) for i in (1, 2)]
    try:
        yield labels
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)


async def test_one_leader_places_and_a_clean_stop_hands_over(
        client: RegistryClient, bus: Bus, settings: Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    source = llama_config(tmp_path / "small", 2048, 16, 8, 16)
    async with fleet(client, settings, tag) as labels:
        replicas = [await Replica(settings, f"{n}-{tag}").start() for n in ("a", "b")]
        try:
            leader = await the_leader(*replicas)
            (standby,) = [r for r in replicas if r is not leader]
            placed = await deploy(client, f"one-{tag}", source, 3, labels)
            assert len({(i.worker_id, g) for i in placed for g in i.gpu_indexes}) == 3
            assert leader.passes > 0 and standby.passes == 0 and not standby.is_leader
            # the standby is registered, answers, and names the leader
            assert len(await ping_ids(bus, 2)) == 2
            await wait_for(lambda: holds(standby.replica.election.leader == leader.name), 10,
                           "the standby to see the leader")
            for _ in range(4):  # whichever replica answers names the same leader
                status = await bus.request(bus.subjects.scheduler_leader, Empty(), SchedulerStatus)
                assert status.leader == leader.name
                assert status.is_leader == (status.replica == leader.name)
                assert (status.leader_since is not None) == status.is_leader

            # a clean stop releases the lock at once: the standby leads and places
            stopping = time.monotonic()
            takeover = asyncio.create_task(the_leader(standby))
            await leader.stop()
            assert await takeover is standby
            elected = time.monotonic() - stopping
            await deploy(client, f"two-{tag}", source, 1, labels)
            print(f"\n[handover] clean stop of the leader -> standby leads in {elected:.3f}s")
        finally:
            for r in replicas:
                await r.stop()


async def test_a_lost_lock_connection_steps_the_leader_down(
        client: RegistryClient, settings: Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    source = llama_config(tmp_path / "small", 2048, 16, 8, 16)
    async with fleet(client, settings, tag) as labels:
        replicas = [await Replica(settings, f"{n}-{tag}").start() for n in ("a", "b")]
        try:
            old = await the_leader(*replicas)
            term = old.replica.election.term
            assert term is not None
            admin = await asyncpg.connect(asyncpg_dsn(settings.database_url))
            try:
                await admin.execute("SELECT pg_terminate_backend($1)", term.fence.pid)
            finally:
                await admin.close()
            await wait_for(lambda: holds(term.ended.is_set()), 5, "the old leader to step down")
            new = await the_leader(*replicas)
            assert new is not old
            passes = old.passes
            await deploy(client, f"lost-{tag}", source, 2, labels)
            assert old.passes == passes and not old.is_leader
            # the old leader campaigns again, as a standby of the new one
            await wait_for(lambda: holds(old.replica.election.leader == new.name), 10,
                           "the old leader to stand by")
        finally:
            for r in replicas:
                await r.stop()


async def test_a_killed_leader_is_replaced_and_failover_is_measured(
        client: RegistryClient, bus: Bus, settings: Settings, tmp_path: Path) -> None:
    """The leader is a real `python -m shoal.services.scheduler` process, SIGKILLed."""
    tag = uuid.uuid4().hex[:6]
    source = llama_config(tmp_path / "small", 2048, 16, 8, 16)
    env = {**os.environ, "SHOAL_NATS_URL": settings.nats_url,
           "SHOAL_DATABASE_URL": settings.database_url, "SHOAL_DATA_DIR": str(tmp_path),
           "SHOAL_NAMESPACE": settings.ns,
           "SHOAL_SCHEDULER_NAME": f"proc-{tag}", "SHOAL_SCHEDULER_INTERVAL": "0.5",
           "SHOAL_SCHEDULER_ELECTION_INTERVAL": "0.5"}
    async with fleet(client, settings, tag) as labels:
        log_file = tmp_path / "scheduler.log"
        with log_file.open("wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "shoal.services.scheduler"], env=env,
                                    stdout=log, stderr=subprocess.STDOUT)
        standby = None
        try:
            async def proc_leads() -> bool:
                assert proc.poll() is None, log_file.read_text()
                with contextlib.suppress(Exception):
                    status = await bus.request(bus.subjects.scheduler_leader, Empty(),
                                               SchedulerStatus)
                    return status.is_leader and status.replica == f"proc-{tag}"
                return False

            await wait_for(proc_leads, 30, "the scheduler process to lead")
            standby = await Replica(settings, f"standby-{tag}").start()
            await wait_for(lambda: holds(standby.replica.election.leader == f"proc-{tag}"), 10,
                           "the standby to see the process lead")
            assert not standby.is_leader

            proc.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await the_leader(standby)
            elected = time.monotonic() - killed
            await deploy(client, f"after-kill-{tag}", source, 1, labels)
            placed = time.monotonic() - killed
            print(f"\n[failover] leader SIGKILLed -> standby leads in {elected:.3f}s, "
                  f"a model deployed after the kill is SCHEDULED {placed:.3f}s after it")
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)
            if standby is not None:
                await standby.stop()
