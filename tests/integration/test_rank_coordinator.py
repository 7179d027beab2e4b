"""Rank 0's control plane over real NATS (services/engine/server/ranks.py): a subordinate
worker gets the plan; a rank exit of this start is named, one of an earlier start is not; a
subordinate worker that stops heartbeating fails the instance naming its ranks and itself."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import pytest

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.server.ranks import RankCoordinator
from shoal.shared.bus.client import Bus
from shoal.shared.config import Settings
from shoal.shared.schemas.ranks import RankExit, RankPlan, RankPlanRequest
from shoal.shared.schemas.registry import (
    DeviceStatus, InstancePublic, ResourceClaim, SubordinateWorker, WorkerHeartbeat
)
from shoal.shared.states import InstanceState

pytestmark = pytest.mark.integration
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def instance() -> InstancePublic:
    return InstancePublic(
        id="rc1", name="m-rc1", model_id="m", model_name="m", state=InstanceState.STARTING,
        worker_id="wa", worker_name="a", tp=1, pp=2,
        subordinate_workers=[SubordinateWorker(worker_id="wb", worker_name="b", gpu_indexes=[],
                                               claim=ResourceClaim())],
        created_at=NOW, updated_at=NOW, state_changed_at=NOW, version=1)


async def test_plan_exits_and_silence(settings: Settings) -> None:
    quick = settings.model_copy(update={"heartbeat_timeout": 1.5, "distributed_host": "127.0.0.1"})
    bus = await Bus.connect(quick, name="rank-coordinator-test")
    coordinator = RankCoordinator(bus, quick, instance(),
                                  EngineConfig(model="/m", device="cpu", pipeline_parallel_size=2))
    await coordinator.start()
    try:
        plan = await bus.request(bus.subjects.ranks("rc1"), RankPlanRequest(worker_id="wb"),
                                 RankPlan)
        assert plan.init_method.startswith("tcp://127.0.0.1:") and plan.world_size == 2
        assert plan.ranks_of("wb") == [1] and coordinator.local_ranks == []
        assert plan.config["distributed_init_method"] == plan.init_method

        def exit_of(generation: str) -> RankExit:
            return RankExit(instance_id="rc1", generation=generation, worker_id="wb",
                            worker_name="b", rank=1, code=-9)

        await bus.publish(bus.subjects.rank_exits("rc1"), exit_of("an-earlier-start"))
        beat = WorkerHeartbeat(worker_id="wb", status=DeviceStatus(cpu_cores=2,
                                                                   memory_total=2**30))
        for _ in range(4):  # b heartbeats: not silent
            await bus.publish(bus.subjects.heartbeat("wb"), beat)
            await asyncio.sleep(0.5)
        assert coordinator.failure_message() is None
        await bus.publish(bus.subjects.rank_exits("rc1"), exit_of(plan.generation))
        for _ in range(50):
            if coordinator.failures():
                break
            await asyncio.sleep(0.1)
        assert coordinator.failures() == {1: "rank 1 on worker b exited with code -9"}

        silent = RankCoordinator(bus, quick, instance(),
                                 EngineConfig(model="/m", device="cpu", pipeline_parallel_size=2))
        await silent.start()
        try:
            for _ in range(100):
                if silent.failure_message():
                    break
                await asyncio.sleep(0.1)
            message = silent.failure_message() or ""
            assert "rank 1 on worker b: the worker went silent" in message, message
        finally:
            await silent.stop()
    finally:
        await coordinator.stop()
        await bus.close()


async def test_silence_counts_from_the_start_not_from_the_preparation(settings: Settings) -> None:
    """The coordinator is made before the model files are prepared and hears heartbeats only
    once started: a preparation longer than the heartbeat timeout is no silence (compose's
    short timeouts failed every pp start at once)."""
    quick = settings.model_copy(update={"heartbeat_timeout": 0.5, "distributed_host": "127.0.0.1"})
    bus = await Bus.connect(quick, name="rank-coordinator-prep")
    coordinator = RankCoordinator(bus, quick, instance(),
                                  EngineConfig(model="/m", device="cpu", pipeline_parallel_size=2))
    await asyncio.sleep(0.8)  # preparing the model files
    await coordinator.start()
    try:
        await coordinator._check_silence()
        assert coordinator.failure_message() is None
    finally:
        await coordinator.stop()
        await bus.close()
