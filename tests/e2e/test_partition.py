"""A network partition (issue 32, item 2) with no Docker: two real workers serving SmolLM2, the
first one's NATS traffic (its agent's and its engines') through a proxy the test cuts silently
(tests/netproxy.py) under a streamed chat. Then:
- the cut worker goes NOT_READY after its heartbeats stop, its instance UNREACHABLE;
- the stream on it ends with an error event (its only replica is the one cut off);
- the instance is rescheduled and RUNNING on the second worker;
- when the network heals, the stale engine on the first worker is fenced: it stops (its own
  placement check, or its supervisor), the registry never shows the replica on two workers or
  twice, a write naming the old placement is refused, and chats are answered by the new one.
The timings it prints are those of the README's "What survives what" row; nothing is timed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from pathlib import Path

import aiohttp
import psutil
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.services.worker.agent import run_worker
from shoal.shared.embedded import free_port
from shoal.shared.errors import Conflict, ShoalError
from shoal.shared.placement_fence import STALE_PLACEMENT
from shoal.shared.schemas.registry import (
    InstanceFilter, InstancePublic, InstanceTransition, ModelCreate
)
from shoal.shared.states import InstanceState, WorkerState
from tests.integration.conftest import make_settings, running_service, running_services
from tests.netproxy import PartitionProxy

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
BODY = {"stream": True, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}]}
ENGINE_ENV = {"SHOAL_ENGINE_PLACEMENT_CHECK_INTERVAL": "1", "SHOAL_DRAIN_TIMEOUT": "3"}
"""The engines are processes of their own: they read these (the placement check, a short
drain) from the environment the worker passes on."""


@contextlib.contextmanager
def engine_env():
    saved = {k: os.environ.get(k) for k in ENGINE_ENV}
    os.environ.update(ENGINE_ENV)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def until(what: str, check, timeout: float = 180.0, every: float = 0.1):
    """Poll `check()` (async) until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(ShoalError):
            if value := await check():
                return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(every)


class Stream:
    def __init__(self) -> None:
        self.tokens = 0
        self.errors: list[dict] = []
        self.done = False

    async def run(self, http: aiohttp.ClientSession, url: str, model: str) -> None:
        async with http.post(f"{url}/v1/chat/completions", json={**BODY, "model": model}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event["error"])
                for choice in event.get("choices", []):
                    self.tokens += bool(choice["delta"].get("content"))
        self.done = True


def engine_pid(data_dir: Path, instance_id: str) -> int:
    return int(json.loads((data_dir / "engines" / f"{instance_id}.json").read_text())["pid"])


def ended(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


async def test_a_partitioned_worker_is_replaced_and_its_engine_fenced(servers, tmp_path) -> None:
    tag = uuid.uuid4().hex[:6]
    proxy = PartitionProxy(*servers.nats_url.removeprefix("nats://").split(":"))
    proxied = f"nats://127.0.0.1:{await proxy.start()}"
    port = free_port()
    settings = make_settings(servers, tmp_path / "a", namespace=f"partition-{tag}",
                             heartbeat_interval=0.5, heartbeat_timeout=3.0,
                             heartbeat_check_interval=0.25, reschedule_after=1.0,
                             scheduler_interval=1.0, drain_timeout=3.0, request_timeout=3.0,
                             gateway_port=port, gateway_engine_dead_after=2.0,
                             gateway_engine_stall_timeout=3.0, engine_restart_max_backoff=2.0)
    labels = {"stack": tag}
    first = {"worker_name": f"cut-{tag}", "worker_labels": labels, "nats_url": proxied}
    second = settings.model_copy(update={"worker_name": f"kept-{tag}", "worker_labels": labels,
                                         "data_dir": tmp_path / "b"})
    with engine_env():
        async with running_services(settings, worker=first, gateway={"gateway_port": port},
                                    name="partition", clean=True) as stack:
            client = stack.client
            model = await client.create_model(ModelCreate(
                name=f"smol-{tag}", source=str(smollm2_gguf_path()), device="cpu",
                max_model_len=512, replicas=1, worker_selector=labels,
                engine_args={"max_num_seqs": 4, "kv_cache_memory": 64 * 2**20,
                             "num_threads": 1}))

            async def instance() -> InstancePublic | None:
                listed = await client.list_instances(InstanceFilter(model_id=model.id))
                assert len(listed) <= 1, f"two copies of one replica: {listed}"
                return listed[0] if listed else None

            old = await until("the instance RUNNING on the first worker", lambda: _running(
                instance, lambda i: i.worker_name == first["worker_name"]), timeout=600)
            old_pid = engine_pid(tmp_path / "a", old.id)
            async with running_service(run_worker, second), aiohttp.ClientSession() as http:
                stream = Stream()
                task = asyncio.create_task(stream.run(http, stack.url, model.name))
                await until("tokens on the stream", lambda: _true(stream.tokens >= 5), 120)

                proxy.cut()
                cut_at = time.monotonic()
                worker = await until("the cut worker NOT_READY", lambda: _worker_state(
                    client, old.worker_id, WorkerState.NOT_READY))
                not_ready = time.monotonic() - cut_at
                await asyncio.wait_for(task, 60)
                assert stream.errors, "the stream on the cut worker ended without an error"
                new = await until("the instance RUNNING on the second worker", lambda: _running(
                    instance, lambda i: i.worker_name == second.worker_name), timeout=600)
                rescheduled = time.monotonic() - cut_at
                assert new.placement_generation > old.placement_generation

                proxy.heal()
                healed_at = time.monotonic()
                seen: list[tuple[str | None, InstanceState]] = []

                async def fenced() -> bool:
                    listed = await client.list_instances(InstanceFilter(model_id=model.id))
                    seen.extend((i.worker_name, i.state) for i in listed)
                    assert len(listed) == 1, f"two copies of one replica: {listed}"
                    return ended(old_pid)

                await until("the stale engine stopped", fenced, timeout=120)
                fence_s = time.monotonic() - healed_at
                assert set(seen) == {(second.worker_name, InstanceState.RUNNING)}, seen
                await until("the cut worker READY again", lambda: _worker_state(
                    client, old.worker_id, WorkerState.READY), timeout=60)
                with pytest.raises(Conflict) as err:  # what the old engine would write
                    await client.transition_instance(InstanceTransition(
                        id=new.id, version=new.version, state=InstanceState.ERROR,
                        placement_generation=old.placement_generation))
                assert err.value.code == STALE_PLACEMENT, err.value
                after = await instance()
                assert (after.worker_name, after.state) == (second.worker_name,
                                                            InstanceState.RUNNING)
                async with http.post(f"{stack.url}/v1/chat/completions", json={
                        "model": model.name, "max_tokens": 5,
                        "messages": [{"role": "user", "content": "Hi"}]}) as r:
                    assert r.status == 200, await r.text()
                log = (tmp_path / "a" / "logs" / f"engine-{old.name}.log").read_text()
                how = "its own placement check" if "fenced:" in log else "its supervisor"
                print(f"\npartition: worker {worker.name} NOT_READY {not_ready:.1f} s after the "
                      f"cut (heartbeat timeout {settings.heartbeat_timeout:g} s), the instance "
                      f"RUNNING on {second.worker_name} {rescheduled:.1f} s after it; the stale "
                      f"engine stopped {fence_s:.1f} s after the heal ({how}); stream: "
                      f"{stream.tokens} tokens, then {stream.errors[0].get('message')!r}")
    await proxy.close()


async def _true(value: bool) -> bool:
    return value


async def _running(instance, where) -> InstancePublic | None:
    inst = await instance()
    running = inst is not None and inst.state is InstanceState.RUNNING and where(inst)
    return inst if running else None


async def _worker_state(client, worker_id: str, state: WorkerState):
    worker = await client.get_worker(worker_id)
    return worker if worker.state is state else None
