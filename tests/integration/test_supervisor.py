"""The worker's Supervisor over the real registry: an engine that cannot be started (here its log
file cannot be opened: an OSError) fails only its own instance, which goes to ERROR with the
reason; the other engines keep running and the loop goes on, starting it once it can."""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import time
import uuid
from pathlib import Path

import pytest
from tests.integration.sched_helpers import wait_for

from shoal.services.worker.engines import AdoptedProcess, EngineProcess
from shoal.services.worker.supervisor import Supervisor
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import (
    DeleteRequest, DeviceStatus, InstanceCreate, InstancePublic, InstanceTransition, ModelCreate,
    Placement, WorkerRegister,
)
from shoal.shared.states import InstanceState

pytestmark = pytest.mark.integration


async def _placed(client: RegistryClient, worker_id: str, model_id: str,
                  state: InstanceState) -> InstancePublic:
    inst = await client.create_instance(InstanceCreate(model_id=model_id))
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
        placement=Placement(worker_id=worker_id)))
    for step in (InstanceState.STARTING, InstanceState.RUNNING):
        if inst.state is state:
            break
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=step))
    return inst


async def test_an_engine_that_cannot_start_fails_alone(client: RegistryClient, bus: Bus,
                                                       settings: Settings,
                                                       tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    worker = await client.register_worker(WorkerRegister(
        name=f"sup-{tag}", hostname="h", status=DeviceStatus(cpu_cores=2, memory_total=2**30)))
    model = await client.create_model(ModelCreate(name=f"sup-{tag}", source="/m", replicas=0))
    serving = await _placed(client, worker.id, model.id, InstanceState.RUNNING)
    doomed = await _placed(client, worker.id, model.id, InstanceState.SCHEDULED)
    local = settings.model_copy(update={"data_dir": tmp_path})
    blocker = tmp_path / "logs" / f"engine-{doomed.name}.log"
    blocker.mkdir(parents=True)  # the engine's log cannot be opened: IsADirectoryError
    engine = subprocess.Popen(["sleep", "600"])  # the running instance's engine (adopted)
    supervisor = Supervisor(local, bus, worker.id)
    supervisor.adopt({serving.id: EngineProcess(serving.id, AdoptedProcess(engine.pid),
                                                tmp_path / "serving.log", time.monotonic())},
                     worker.name)
    stop = asyncio.Event()
    task = asyncio.create_task(supervisor.run(stop))
    try:
        async def failed() -> InstancePublic | None:
            inst = await client.get_instance(doomed.id)
            return inst if inst.state is InstanceState.ERROR else None

        inst = await wait_for(failed, 15, "the instance that cannot start in ERROR")
        assert "IsADirectoryError" in inst.state_message, inst.state_message
        assert str(blocker) in inst.state_message
        assert inst.restart_count == 1
        await asyncio.sleep(1.0)  # more passes
        assert not task.done(), task
        assert engine.poll() is None, "the other engine was stopped"
        assert (await client.get_instance(serving.id)).state is InstanceState.RUNNING

        blocker.rmdir()  # the cause goes away: the loop starts the engine after its back-off

        async def started() -> bool:
            return blocker.is_file()

        await wait_for(started, 20, "the engine started once it could")
        assert engine.poll() is None and not task.done()
    finally:
        stop.set()
        await asyncio.wait_for(task, 60)
        engine.kill()
        engine.wait()
        with contextlib.suppress(Exception):
            await client.delete_model(DeleteRequest(id=model.id))
