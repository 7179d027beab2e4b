"""The scheduler over real NATS + Postgres with simulated workers: placement, rescheduling after a
worker goes silent, reasons on an impossible model, and two replicas racing for one instance."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from tests.integration.sched_helpers import (
    all_scheduled, delete_models, instances_of, llama_config, start_worker, stop_workers,
    wait_for,
)

from shoal.services.scheduler.claim import ModelProfile
from shoal.services.scheduler.planner import Planner, ProfileCache, plan_placement
from shoal.services.scheduler.reconcile import SchedulerConfig
from shoal.services.scheduler.service import SchedulerService
from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import (
    InstanceCreate, InstanceDelete, InstancePublic, ModelCreate, ModelUpdate,
)
from shoal.shared.states import InstanceState, WorkerState

pytestmark = pytest.mark.integration
GIB = 2**30


@contextlib.asynccontextmanager
async def running_scheduler(settings: Settings) -> AsyncIterator[SchedulerService]:
    bus = await Bus.connect(settings, name=f"scheduler-test-{uuid.uuid4().hex[:6]}")
    config = SchedulerConfig(interval=0.5, reschedule_after=settings.reschedule_after)
    service = SchedulerService(RegistryClient(bus), config)
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(service.run(bus, stop, ready))
    await asyncio.wait_for(ready.wait(), 10)
    try:
        yield service
    finally:
        stop.set()
        await asyncio.wait_for(task, 15)
        await bus.close()


async def test_place_reschedule_and_explain(client: RegistryClient, settings: Settings,
                                            tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    labels = {"suite": tag}
    workers = [await start_worker(settings, f"{tag}-w{i}", "2xH100-80GB", labels)
               for i in range(1, 5)]
    sources = {
        "small": llama_config(tmp_path / "small", 2048, 16, 8, 16),  # ~1B: one GPU
        "big": llama_config(tmp_path / "big", 8192, 64, 8, 80),  # ~70B: two 80 GB GPUs, TP=2
        "smol": str(smollm2_gguf_path()),  # the real GGUF: one GPU
        "huge": llama_config(tmp_path / "huge", 16384, 128, 16, 200),  # fits nowhere
    }
    replicas = {"small": 2, "big": 1, "smol": 1, "huge": 1}
    try:
        async with running_scheduler(settings):
            models = {}
            for key in ("small", "big", "smol", "huge"):
                models[key] = await client.create_model(ModelCreate(
                    name=f"{key}-{tag}", source=sources[key], replicas=replicas[key],
                    worker_selector=labels, device="gpu"))
            placed = {}
            for key in ("small", "big", "smol"):
                placed[key] = await wait_for(lambda k=key: all_scheduled(
                    client, models[k].id, replicas[k]), 20, f"{key} SCHEDULED")
            # binpack, oldest instance first: small fills w1, big takes w2 (TP=2), smol w3
            where = {k: sorted((i.worker_name, tuple(i.gpu_indexes), i.tp, i.pp) for i in v)
                     for k, v in placed.items()}
            assert where["small"] == [(f"{tag}-w1", (0,), 1, 1), (f"{tag}-w1", (1,), 1, 1)]
            assert where["big"] == [(f"{tag}-w2", (0, 1), 2, 1)]
            assert where["smol"] == [(f"{tag}-w3", (0,), 1, 1)]
            big = placed["big"][0]
            assert big.claim.gpu_memory == {0: int(80 * GIB * 0.9), 1: int(80 * GIB * 0.9)}

            async def pending_with_reason() -> InstancePublic | None:
                found = await instances_of(client, models["huge"].id)
                ok = found and found[0].state is InstanceState.PENDING and found[0].state_message
                return found[0] if ok else None

            huge = await wait_for(pending_with_reason, 10, "a reason on the impossible model")
            for part in ("The model needs", "of GPU memory", "No single GPU fits",
                         "The largest qualifying GPU is", "72.0 GiB", "multi-worker combination"):
                assert part in huge.state_message, huge.state_message

            # w2 stops (and says so): NOT_READY, big UNREACHABLE, then placed on w4 (2 free GPUs)
            task, stop = workers[1]
            stop.set()
            await task

            async def moved() -> InstancePublic | None:
                found = await instances_of(client, models["big"].id)
                ok = (len(found) == 1 and found[0].state is InstanceState.SCHEDULED
                      and found[0].worker_name != f"{tag}-w2")
                return found[0] if ok else None

            timeout = settings.heartbeat_timeout + settings.reschedule_after + 10
            big = await wait_for(moved, timeout, "big rescheduled off the silent worker")
            assert (big.worker_name, big.gpu_indexes, big.tp) == (f"{tag}-w4", [0, 1], 2)
            assert big.id == placed["big"][0].id  # the same instance, placed again
            w2 = next(w for w in await client.list_workers() if w.name == f"{tag}-w2")
            assert w2.state is WorkerState.NOT_READY

            # the dry run sees the same fleet and writes nothing
            before = len(await client.list_instances())
            plan = plan_placement(models["small"], await client.list_workers(),
                                  await client.list_instances())
            assert plan.ok and plan.placement.worker_id != w2.id
            assert len(await client.list_instances()) == before

            # scaling down deletes the extra instance
            small = await client.get_model(id=models["small"].id)
            await client.update_model(ModelUpdate(id=small.id, version=small.version, replicas=1))
            await wait_for(lambda: all_scheduled(client, small.id, 1), 10, "small scaled to 1")
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)


async def test_two_schedulers_never_double_place(client: RegistryClient, bus: Bus,
                                                 settings: Settings, tmp_path: Path) -> None:
    tag = uuid.uuid4().hex[:6]
    labels = {"suite": tag}
    source = llama_config(tmp_path / "small", 2048, 16, 8, 16)
    workers = [await start_worker(settings, f"{tag}-w{i}", "2xH100-80GB", labels)
               for i in (1, 2)]
    try:
        # the same PENDING instance, placed by two schedulers at once: one write wins
        model = await client.create_model(ModelCreate(name=f"race-{tag}", source=source,
                                                      replicas=1, worker_selector=labels))
        inst = await client.create_instance(InstanceCreate(model_id=model.id))
        fleet, everything = await client.list_workers(), await client.list_instances()
        one = SchedulerService(RegistryClient(bus), SchedulerConfig())
        two = SchedulerService(RegistryClient(bus), SchedulerConfig())
        request = await one._request(model)
        outcomes = await asyncio.gather(
            one.place(inst, model, request, Planner(fleet, everything)),
            two.place(inst, model, request, Planner(fleet, everything)))
        assert sorted(outcomes) == ["conflict", "scheduled"]
        final = await client.get_instance(inst.id)
        assert final.state is InstanceState.SCHEDULED and final.version > inst.version

        # two running replicas scale a model to 4: 4 instances on 4 distinct GPUs
        model = await client.get_model(id=model.id)
        await client.update_model(ModelUpdate(id=model.id, version=model.version, replicas=4))
        async with running_scheduler(settings), running_scheduler(settings):
            # (60 s: a worker NOT_READY for a missed heartbeat on a loaded CI machine comes back)
            found = await wait_for(lambda: all_scheduled(client, model.id, 4), 60, "4 SCHEDULED")
            await asyncio.sleep(1.5)  # a few more passes of both: nothing changes
            again = await instances_of(client, model.id)
        assert sorted(i.id for i in again) == sorted(i.id for i in found)
        gpus = [(i.worker_id, g) for i in again for g in i.gpu_indexes]
        assert len(gpus) == 4 and len(set(gpus)) == 4
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)


def _bad_sources(root: Path) -> dict[str, tuple[str, str]]:
    """Model sources whose files cannot be parsed, with the reason each must be named by."""
    def folder(name: str, config: bytes) -> str:
        (root / name).mkdir(parents=True)
        (root / name / "config.json").write_bytes(config)
        return str(root / name)

    crafted = root / "crafted.gguf"  # a valid magic and version, then an absurd tensor count
    crafted.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1) + bytes(64))
    return {
        "comma": (folder("comma", b'{"hidden_size": 64,\n "num_attention_heads": 4,\n}'),
                  "config.json is not valid JSON: Expecting property name"),
        "latin": (folder("latin", b"\xff\xfe{}"), "config.json is not UTF-8 text"),
        "array": (folder("array", b"[1, 2]"), "config.json is a JSON array, not an object"),
        "gguf": (str(crafted), "crafted.gguf is not a readable GGUF file"),
    }


async def test_a_bad_model_fails_alone(client: RegistryClient, settings: Settings,
                                       tmp_path: Path) -> None:
    """Models whose files are malformed (broken after the deploy, or deployed while no scheduler
    answered) stay PENDING with the reason, and every other model is still placed in the same
    passes: a deleted instance is replaced and placed."""
    tag = uuid.uuid4().hex[:6]
    labels = {"suite": tag}
    workers = [await start_worker(settings, f"{tag}-w1", "2xH100-80GB", labels)]
    bad = _bad_sources(tmp_path)
    try:
        async with running_scheduler(settings):
            broken = {key: await client.create_model(ModelCreate(  # older: placed first
                name=f"{key}-{tag}", source=source, worker_selector=labels, device="gpu"))
                for key, (source, _) in bad.items()}
            good = await client.create_model(ModelCreate(
                name=f"good-{tag}", source=llama_config(tmp_path / "good", 2048, 16, 8, 16),
                worker_selector=labels, device="gpu"))
            (placed,) = await wait_for(lambda: all_scheduled(client, good.id, 1), 20,
                                       "the good model SCHEDULED")
            for key, model in broken.items():
                async def pending(m=model):  # noqa: ANN001, ANN202
                    found = await instances_of(client, m.id)
                    ok = found and found[0].state is InstanceState.PENDING and \
                        found[0].state_message
                    return found[0] if ok else None

                inst = await wait_for(pending, 10, f"{key}: PENDING with its reason")
                assert bad[key][1] in inst.state_message, inst.state_message
                assert inst.state_message.startswith("Cannot size the model from "), key

            await client.delete_instance(InstanceDelete(id=placed.id))

            async def replaced():  # noqa: ANN202
                found = await all_scheduled(client, good.id, 1)
                return found if found and found[0].id != placed.id else None

            await wait_for(replaced, 20, "the deleted instance replaced and placed")
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)


class FlakyProfiles(ProfileCache):
    """A profile reader with a bug for one source (defence in depth: an exception the reader
    never meant to raise must still fail only that model)."""

    def __init__(self, broken: str) -> None:
        super().__init__()
        self.broken = broken

    def get(self, source: str) -> ModelProfile:
        if source == self.broken:
            raise RuntimeError("a bug in the reader")
        return super().get(source)


async def test_an_unexpected_error_fails_only_its_model(
        client: RegistryClient, bus: Bus, settings: Settings, tmp_path: Path,
        caplog: pytest.LogCaptureFixture) -> None:
    tag = uuid.uuid4().hex[:6]
    labels = {"suite": tag}
    workers = [await start_worker(settings, f"{tag}-w1", "2xH100-80GB", labels)]
    bug = llama_config(tmp_path / "bug", 2048, 16, 8, 16)
    service = SchedulerService(client, SchedulerConfig(interval=0.2), FlakyProfiles(bug))
    try:
        buggy = await client.create_model(ModelCreate(name=f"bug-{tag}", source=bug,
                                                      worker_selector=labels, device="gpu"))
        good = await client.create_model(ModelCreate(
            name=f"good-{tag}", source=llama_config(tmp_path / "good", 2048, 16, 8, 16),
            worker_selector=labels, device="gpu"))
        with caplog.at_level(logging.ERROR, logger="shoal.services.scheduler.service"):
            for _ in range(3):  # three passes: the traceback is logged once
                await service.reconcile()
        assert await all_scheduled(client, good.id, 1)
        (inst,) = await instances_of(client, buggy.id)
        assert inst.state is InstanceState.PENDING
        assert "RuntimeError: a bug in the reader" in inst.state_message
        logged = [r for r in caplog.records if r.exc_info and "a bug in the reader" in str(
            r.exc_info[1])]
        assert len(logged) == 1, caplog.text
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)


async def test_an_update_of_how_it_runs_rolls_the_instances(client: RegistryClient,
                                                            settings: Settings,
                                                            tmp_path: Path) -> None:
    """A PATCH of engine_args (or a backend field) bumps run_revision: the scheduler starts a
    replacement while the old instance serves, and deletes the old one once it is RUNNING (a
    simulated worker starts no engine: the test moves states as a worker would)."""
    from shoal.shared.schemas.registry import InstanceTransition

    tag = uuid.uuid4().hex[:6]
    labels = {"suite": tag}
    workers = [await start_worker(settings, f"{tag}-w1", "2xH100-80GB", labels)]

    async def run(instance: InstancePublic) -> None:
        for state in (InstanceState.STARTING, InstanceState.RUNNING):
            instance = await client.transition_instance(InstanceTransition(
                id=instance.id, version=instance.version, state=state))

    try:
        source = llama_config(tmp_path / "small", 2048, 16, 8, 16)
        model = await client.create_model(ModelCreate(name=f"roll-{tag}", source=source,
                                                      replicas=1, worker_selector=labels))
        async with running_scheduler(settings):
            [old] = await wait_for(lambda: all_scheduled(client, model.id, 1), 20, "SCHEDULED")
            await run(old)
            model = await client.get_model(id=model.id)
            model = await client.update_model(ModelUpdate(
                id=model.id, version=model.version, engine_args={"max_num_seqs": 4}))
            assert model.run_revision == 1

            async def replacement() -> list[InstancePublic] | None:
                found = await instances_of(client, model.id)
                new = [i for i in found if i.run_revision == 1
                       and i.state is InstanceState.SCHEDULED]
                return new if new and len(found) == 2 else None

            [new] = await wait_for(replacement, 20, "a replacement beside the old one")
            assert (await client.get_instance(old.id)).state is InstanceState.RUNNING
            await asyncio.sleep(1.2)  # more passes: the old one serves until the new one does
            assert len(await instances_of(client, model.id)) == 2
            await run(await client.get_instance(new.id))

            async def rolled() -> list[InstancePublic] | None:
                found = await instances_of(client, model.id)
                return found if [i.id for i in found] == [new.id] else None

            await wait_for(rolled, 20, "the old instance deleted")
    finally:
        await stop_workers(workers)
        await delete_models(client, tag)
