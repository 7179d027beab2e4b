"""The service's reconcile pass against an in-memory registry: writes, settling, conflicts, and
writing only during a term as leader, with its fence."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from itertools import count
from typing import Any

import pytest
from tests.unit.scheduler.sched_fleet import NOW, placed, worker

from shoal.services.scheduler.election import Term
from shoal.shared.loops import first_of
from shoal.services.scheduler.planner import ProfileCache
from shoal.services.scheduler.reconcile import SchedulerConfig
from shoal.services.scheduler.service import SchedulerService
from shoal.shared.db.leader_lock import NOT_LEADER
from shoal.shared.errors import Conflict, NotFound
from shoal.shared.schemas.registry import (
    Deleted, InstanceCreate, InstanceDelete, InstanceFilter, InstancePublic, InstanceTransition,
    LeaderFence, ListRequest, ModelPublic, Placement, WorkerPublic,
)
from shoal.shared.states import InstanceState, check_transition


class FakeRegistry:
    """Just enough of RegistryClient: versioned writes, refused when stale."""

    def __init__(self, models: list[ModelPublic], workers: list[WorkerPublic]) -> None:
        self.models, self.workers = models, workers
        self.instances: dict[str, InstancePublic] = {}
        self.writes = 0
        self.ids = count(1)
        self.fences: list[LeaderFence | None] = []
        """The fence of every write, in order."""
        self.leader_fence: LeaderFence | None = None
        """When set, writes with another fence are refused, as the registry's fence check does."""

    def _check_fence(self, fence: LeaderFence | None) -> None:
        self.fences.append(fence)
        if self.leader_fence is not None and fence != self.leader_fence:
            raise Conflict("no longer leads", code=NOT_LEADER)

    async def list_models(self, req: ListRequest) -> list[ModelPublic]:
        return self.models[req.offset: req.offset + req.limit]

    async def list_workers(self, req: ListRequest) -> list[WorkerPublic]:
        return self.workers[req.offset: req.offset + req.limit]

    async def list_instances(self, req: InstanceFilter | None = None) -> list[InstancePublic]:
        return list(self.instances.values())

    async def create_instance(self, req: InstanceCreate) -> InstancePublic:
        self._check_fence(req.fence)
        self.writes += 1
        n = next(self.ids)
        inst = placed(Placement(worker_id="x"), model_id=req.model_id).model_copy(update={
            "id": f"i{n}", "name": f"inst-{n}", "state": InstanceState.PENDING, "worker_id": None,
            "created_at": NOW.replace(microsecond=n)})
        self.instances[inst.id] = inst
        return inst

    async def transition_instance(self, req: InstanceTransition) -> InstancePublic:
        self._check_fence(req.fence)
        inst = self.instances.get(req.id)
        if inst is None:
            raise NotFound(req.id)
        if inst.version != req.version:
            raise Conflict(f"{req.id} is at version {inst.version}, not {req.version}")
        if req.state is not inst.state:
            check_transition(inst.state, req.state)
        update: dict[str, object] = {"state": req.state, "state_message": req.state_message,
                                     "version": inst.version + 1}
        if req.placement is not None:
            update.update(worker_id=req.placement.worker_id, gpu_indexes=req.placement.gpu_indexes,
                          claim=req.placement.claim, tp=req.placement.tp, pp=req.placement.pp)
        self.writes += 1
        self.instances[req.id] = inst.model_copy(update=update)
        return self.instances[req.id]

    async def delete_instance(self, req: InstanceDelete) -> Deleted:
        self._check_fence(req.fence)
        self.writes += 1
        self.instances.pop(req.id)
        return Deleted(id=req.id)


def model(mid: str, source: str, replicas: int) -> ModelPublic:
    return ModelPublic(id=mid, name=mid, source=source, replicas=replicas, created_at=NOW,
                       updated_at=NOW, version=1, device="gpu")


@pytest.fixture()
def config_folder(tmp_path):  # noqa: ANN001, ANN201
    import json

    def make(name: str, hidden: int, layers: int) -> str:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "hidden_size": hidden,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_hidden_layers": layers,
            "intermediate_size": hidden * 3, "vocab_size": 32000,
            "max_position_embeddings": 4096}))
        return str(folder)

    return make


async def test_a_pass_places_explains_and_then_settles(config_folder) -> None:  # noqa: ANN001
    fleet = [worker("a", 2)]
    registry = FakeRegistry([model("small", config_folder("s", 2048, 16), 2),
                             model("huge", config_folder("h", 16384, 200), 1)], fleet)
    service = SchedulerService(registry, SchedulerConfig(), ProfileCache())  # type: ignore[arg-type]
    stats = await service.reconcile()
    assert (stats.created, stats.scheduled, stats.pending) == (3, 2, 1)
    by_model = {}
    for inst in registry.instances.values():
        by_model.setdefault(inst.model_id, []).append(inst)
    assert sorted(i.gpu_indexes[0] for i in by_model["small"]) == [0, 1]
    (huge,) = by_model["huge"]
    assert huge.state is InstanceState.PENDING and huge.state_message.startswith("The model needs")
    # huge was explained first, on empty GPUs: the next pass rewrites its numbers once
    await service.reconcile()
    assert "90% claimed, 8.00 GiB unclaimed" in registry.instances[huge.id].state_message
    writes = registry.writes
    stats = await service.reconcile()  # nothing changed: nothing is written
    assert registry.writes == writes and stats.outcomes["unchanged"] == 1


async def test_a_stale_version_is_dropped_not_retried(config_folder) -> None:  # noqa: ANN001
    registry = FakeRegistry([model("small", config_folder("s", 2048, 16), 1)], [worker("a", 1)])
    service = SchedulerService(registry, SchedulerConfig(), ProfileCache())  # type: ignore[arg-type]
    inst = await registry.create_instance(InstanceCreate(model_id="small"))
    stale = inst.model_copy(update={"version": inst.version})
    await registry.transition_instance(InstanceTransition(  # someone else writes first
        id=inst.id, version=inst.version, state=InstanceState.PENDING, state_message="other"))
    request = await service._request(registry.models[0])
    from shoal.services.scheduler.planner import Planner

    outcome = await service.place(stale, registry.models[0], request, Planner(registry.workers))
    assert outcome == "conflict"
    assert registry.instances[inst.id].state is InstanceState.PENDING


class IdleBus:
    """The event consumer's bus: no events (the periodic pass does the work)."""

    async def consume(self, durable: str, subject: str, handler: object,
                      stop: asyncio.Event) -> None:
        await stop.wait()


class HandedLeadership:
    """Terms handed out by the test, as the election would."""

    def __init__(self) -> None:
        self.term: Term | None = None
        self.changed = asyncio.Event()

    def elect(self, term: Term) -> None:
        self.term = term
        self.changed.set()

    async def next_term(self, stop: asyncio.Event) -> Term | None:
        while not stop.is_set():
            if self.term is not None and not self.term.ended.is_set():
                return self.term
            self.changed.clear()
            await first_of(self.changed.wait(), stop.wait())
        return None


async def until(predicate: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.01)


async def test_only_a_term_writes_and_every_write_carries_its_fence(
        config_folder) -> None:  # noqa: ANN001
    registry = FakeRegistry([model("small", config_folder("s", 2048, 16), 2)], [worker("a", 2)])
    service = SchedulerService(registry, SchedulerConfig(interval=0.05),  # type: ignore[arg-type]
                               ProfileCache())
    leadership, stop = HandedLeadership(), asyncio.Event()
    bus: Any = IdleBus()
    task = asyncio.create_task(service.run(bus, stop, leadership=leadership))
    try:
        for _ in range(20):
            await asyncio.sleep(0)
        assert service.passes == 0 and registry.writes == 0  # a standby does nothing

        term = Term(fence=LeaderFence(pid=7, token=42), started_at=NOW)
        registry.leader_fence = term.fence
        leadership.elect(term)
        await until(lambda: sum(i.state is InstanceState.SCHEDULED
                                for i in registry.instances.values()) == 2, "2 SCHEDULED")
        assert service.fence == term.fence
        assert registry.fences and all(f == term.fence for f in registry.fences)

        term.ended.set()  # the lock is lost: the service stops before anything else happens
        await until(lambda: service.fence is None, "the term to end")
        passes, writes = service.passes, registry.writes
        registry.models[0] = model("small", registry.models[0].source, 3)
        for _ in range(20):
            await asyncio.sleep(0)
        assert (service.passes, registry.writes) == (passes, writes)
    finally:
        stop.set()
        await asyncio.wait_for(task, 5)


async def test_a_refused_fence_ends_the_pass(config_folder) -> None:  # noqa: ANN001
    registry = FakeRegistry([model("small", config_folder("s", 2048, 16), 2)], [worker("a", 2)])
    registry.leader_fence = LeaderFence(pid=8, token=1)  # another replica leads now
    service = SchedulerService(registry, SchedulerConfig(),  # type: ignore[arg-type]
                               ProfileCache())
    service.fence = LeaderFence(pid=7, token=42)
    with pytest.raises(Conflict) as refused:
        await service.reconcile()
    assert refused.value.code == NOT_LEADER
    assert registry.fences == [service.fence] and registry.writes == 0
