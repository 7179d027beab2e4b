"""A worker agent that stops cleanly tells the registry (`workers.leave`): the worker is
NOT_READY at once and the scheduler moves its instances as it does a silent worker's, long
before the heartbeat timeout; the instances whose engines it left running keep serving, and the
next agent adopts them as after a crash."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import (
    DeviceStatus, InstanceCreate, InstanceTransition, ModelCreate, Placement, WorkerHeartbeat,
    WorkerLeave, WorkerRegister,
)
from shoal.shared.states import InstanceState, WorkerState
from tests.integration.conftest import make_settings, running_services
from tests.integration.sched_helpers import (
    all_scheduled, instances_of, llama_config, start_worker, stop_workers, wait_for,
)
from tests.integration.test_namespaces import _second_database

pytestmark = pytest.mark.integration


async def test_a_stopped_worker_is_not_ready_at_once_and_its_instance_moves(
        servers, tmp_path: Path) -> None:
    # a heartbeat timeout far past the test: only the agent's word can explain what follows
    settings = make_settings(servers, tmp_path,
                             database_url=await _second_database(servers.database_url),
                             heartbeat_timeout=600.0, reschedule_after=1.0,
                             scheduler_interval=0.5)
    labels = {"suite": uuid.uuid4().hex[:6]}
    async with running_services(settings, name="leave-test") as stack:
        client = stack.client
        first = await start_worker(settings, "leaving", "1xH100-80GB", labels)
        second = None
        try:
            model = await client.create_model(ModelCreate(
                name="small", source=llama_config(tmp_path / "small", 2048, 16, 8, 16),
                worker_selector=labels, device="gpu"))
            (placed,) = await wait_for(lambda: all_scheduled(client, model.id, 1), 20,
                                       "SCHEDULED on the first worker")
            assert placed.worker_name == "leaving"
            second = await start_worker(settings, "staying", "1xH100-80GB", labels)

            await stop_workers([first])  # a clean stop (SIGTERM, Ctrl-C)
            worker = await client.get_worker(placed.worker_id)  # no wait: already told
            assert worker.state is WorkerState.NOT_READY
            assert worker.state_message == "the worker agent stopped"

            async def moved():
                found = await all_scheduled(client, model.id, 1)
                return found if found and found[0].worker_name == "staying" else None

            (again,) = await wait_for(moved, 30, "SCHEDULED on the other worker")
            assert again.id == placed.id
        finally:
            await stop_workers([w for w in (first, second) if w is not None])


async def _heartbeat_handled(client: RegistryClient, worker_id: str,
                             status: DeviceStatus) -> None:
    bus = client.bus
    before = (await client.get_worker(worker_id)).last_heartbeat_at

    async def recorded() -> bool:
        await bus.publish(bus.subjects.heartbeat(worker_id),
                          WorkerHeartbeat(worker_id=worker_id, status=status))
        await asyncio.sleep(0.1)
        return (await client.get_worker(worker_id)).last_heartbeat_at != before

    await wait_for(recorded, 10, "the heartbeat recorded")


async def _placed(client: RegistryClient, worker_id: str, state: InstanceState):
    model = await client.create_model(ModelCreate(name=f"kept-{uuid.uuid4().hex[:6]}",
                                                  source="/m"))
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
        placement=Placement(worker_id=worker_id)))
    for step in (InstanceState.STARTING, InstanceState.RUNNING):
        if inst.state is state:
            break
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=step))
    return inst


async def test_engines_left_running_keep_serving_and_are_adopted(
        client: RegistryClient, settings: Settings) -> None:
    """The agent's requests as a stop with SHOAL_WORKER_KEEP_ENGINES and a restart make them
    (a real agent reports its records of live engines; tests/e2e/test_agent_restart.py runs
    real engines)."""
    name = f"keep-{uuid.uuid4().hex[:6]}"
    status = DeviceStatus(cpu_cores=2, memory_total=2**30)
    register = WorkerRegister(name=name, hostname="h", status=status)
    worker = await client.register_worker(register)
    kept = await _placed(client, worker.id, InstanceState.RUNNING)
    starting = await _placed(client, worker.id, InstanceState.STARTING)

    left = await client.leave_worker(WorkerLeave(id=worker.id, running=[kept.id]))
    assert left.state is WorkerState.NOT_READY
    assert left.state_message == "the worker agent stopped; 1 engine(s) left running"
    assert (await client.get_instance(kept.id)).version == kept.version  # untouched: RUNNING
    gone = await client.get_instance(starting.id)
    assert gone.state is InstanceState.UNREACHABLE
    assert gone.state_message == f"worker {name} stopped"

    # a heartbeat the agent sent just before it left, handled after: the worker stays away
    await _heartbeat_handled(client, worker.id, status)
    assert (await client.get_worker(worker.id)).state is WorkerState.NOT_READY

    back = await client.register_worker(register.model_copy(update={"running": [kept.id]}))
    assert back.state is WorkerState.READY
    assert (await client.get_instance(kept.id)).version == kept.version  # adopted as it was
    assert (await client.get_instance(starting.id)).state is InstanceState.SCHEDULED

    # an agent that leaves and never comes back: its kept engines are taken out of service
    # once its heartbeats are missed, as if it had died
    await client.leave_worker(WorkerLeave(id=worker.id, running=[kept.id]))

    async def timed_out():
        inst = await client.get_instance(kept.id)
        return inst if inst.state is InstanceState.UNREACHABLE else None

    lost = await wait_for(timed_out, settings.heartbeat_timeout + 10, "UNREACHABLE")
    assert lost.state_message == f"worker {name} stopped heartbeating"
    gone_worker = await client.get_worker(worker.id)  # no longer "engine(s) left running":
    assert gone_worker.state_message.startswith("the worker agent stopped; no heartbeat since")
    assert [i.state for i in await instances_of(client, starting.model_id)] == [
        InstanceState.UNREACHABLE]
