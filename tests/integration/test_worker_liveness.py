"""Worker agent + registry: registration, heartbeats, NOT_READY / UNREACHABLE and back."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest

from shoal.services.worker.agent import run_worker
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import InstanceCreate, InstanceTransition, ModelCreate, Placement
from shoal.shared.states import InstanceState, WorkerState

pytestmark = pytest.mark.integration


async def start_worker(settings: Settings, name: str, devices: str) -> tuple[asyncio.Task[None],
                                                                             asyncio.Event]:
    stop, ready = asyncio.Event(), asyncio.Event()
    worker_settings = settings.model_copy(update={"worker_name": name, "simulate_devices": devices})
    task = asyncio.create_task(run_worker(worker_settings, stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    return task, stop


async def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await predicate()
        if value:
            return value
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def crash(task: asyncio.Task[None]) -> None:
    """The agent dies without a word (a clean stop would tell the registry it leaves)."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def find_worker(client: RegistryClient, name: str):
    return next((w for w in await client.list_workers() if w.name == name), None)


async def test_simulated_worker_registers(client: RegistryClient, settings: Settings) -> None:
    name = f"sim-{uuid.uuid4().hex[:6]}"
    task, stop = await start_worker(settings, name, "2xA10-24GB,1xcpu")
    try:
        worker = await find_worker(client, name)
        assert worker is not None and worker.simulated and worker.state is WorkerState.READY
        gpus = [(g.index, g.name, g.memory_total) for g in worker.status.gpus]
        assert gpus == [(0, "A10", 24 * 2**30), (1, "A10", 24 * 2**30)]
    finally:
        stop.set()
        await task


async def test_silent_worker_goes_not_ready_and_comes_back(client: RegistryClient,
                                                           settings: Settings) -> None:
    name = f"sim-{uuid.uuid4().hex[:6]}"
    task, stop = await start_worker(settings, name, "1xH100-80GB")
    worker = await find_worker(client, name)
    model = await client.create_model(ModelCreate(name=f"live-{uuid.uuid4().hex[:6]}", source="/m"))
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
        placement=Placement(worker_id=worker.id, gpu_indexes=[0])))

    await crash(task)  # heartbeats stop
    silenced = time.monotonic()

    async def not_ready():
        w = await client.get_worker(worker.id)
        return w if w.state is WorkerState.NOT_READY else None

    down = await wait_for(not_ready, settings.heartbeat_timeout + 3, "NOT_READY")
    elapsed = time.monotonic() - silenced
    assert elapsed <= settings.heartbeat_timeout + settings.heartbeat_check_interval + 1.5, elapsed
    assert "no heartbeat since" in (down.state_message or "")
    unreachable = await client.get_instance(inst.id)
    assert unreachable.state is InstanceState.UNREACHABLE
    assert name in (unreachable.state_message or "")

    task, stop = await start_worker(settings, name, "1xH100-80GB")  # it comes back
    try:
        async def ready():
            w = await client.get_worker(worker.id)
            return w if w.state is WorkerState.READY else None

        await wait_for(ready, 5, "READY again")
        back = await client.get_instance(inst.id)
        assert back.state is InstanceState.SCHEDULED and back.worker_id == worker.id
    finally:
        stop.set()
        await task


async def test_reregistering_worker_restarts_its_running_instances(client: RegistryClient,
                                                                   settings: Settings) -> None:
    """A worker that registers again runs no engine: its RUNNING instance must not stay RUNNING."""
    name = f"sim-{uuid.uuid4().hex[:6]}"
    task, stop = await start_worker(settings, name, "1xA10-24GB")
    worker = await find_worker(client, name)
    model = await client.create_model(ModelCreate(name=f"rr-{uuid.uuid4().hex[:6]}", source="/m"))
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
        placement=Placement(worker_id=worker.id)))
    for state in (InstanceState.STARTING, InstanceState.RUNNING):
        inst = await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version,
                                                                   state=state))
    await crash(task)
    task, stop = await start_worker(settings, name, "1xA10-24GB")  # restarted before the timeout
    try:
        again = await client.get_instance(inst.id)
        assert again.state is InstanceState.STARTING and "restarted" in (again.state_message or "")
        assert again.worker_id == worker.id
    finally:
        stop.set()
        await task
