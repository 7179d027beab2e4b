"""Autoscaling: time from a load step to the new replica serving.

A whole stack in this process (embedded NATS and PostgreSQL, registry, scheduler, one worker,
gateway) serves all-MiniLM-L6-v2 with autoscaling (waiting requests per instance, target 1,
1..2 replicas, no cool-down). Clients then send embedding requests as fast as they are answered
(the load step), and we time: the scheduler's decision (replicas 1 -> 2, with its reason), the
second instance RUNNING, and its first answer (its load shows tokens embedded).

    .venv/bin/python -m loadtests.autoscale_step --clients 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from shoal.services.engine.model_prep import minilm_path
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.schemas.registry import InstanceFilter
from shoal.shared.states import InstanceState

RESULTS = Path(__file__).parent / "results"
TEXT = ("Autoscaling adds replicas when requests wait in the engines' queues and removes them "
        "when the queues stay empty. ") * 3
AUTOSCALING = {"min_replicas": 1, "max_replicas": 2, "metric": "waiting_per_instance",
               "target": 1.0, "scale_up_cooldown": 0, "scale_down_cooldown": 30}


@dataclass
class StepResult:
    decided_s: float | None = None
    running_s: float | None = None
    serving_s: float | None = None
    reason: str | None = None
    requests: int = 0


async def wait_running(client: RegistryClient, model_id: str, count: int,
                       timeout: float = 300) -> list[str]:
    """The ids of `count` RUNNING instances of the model; on a timeout the error says what was
    seen instead (each instance's states as polled, the model's replicas and scale events)."""
    start = time.monotonic()
    seen: dict[str, list[str]] = {}  # each instance's states, as they changed
    last: dict[str, str] = {}
    while time.monotonic() - start < timeout:
        instances = await client.list_instances(InstanceFilter(model_id=model_id))
        running = [i for i in instances if i.state is InstanceState.RUNNING]
        if len(running) >= count:
            return [i.id for i in running]
        for i in instances:
            state = i.state.value + (f" ({i.state_message})" if i.state_message else "")
            if last.get(i.name) != state:  # a change: note it and when
                last[i.name] = state
                seen.setdefault(i.name, []).append(f"{state} @{time.monotonic() - start:.1f}s")
        await asyncio.sleep(0.2)
    model = await client.get_model(id=model_id)
    events = "; ".join(f"{e.at:%H:%M:%S} {e.from_replicas}->{e.to_replicas} {e.reason}"
                       for e in model.scale_events[-5:])
    raise TimeoutError(f"{count} RUNNING instance(s) not reached in {timeout}s: model "
                       f"{model.name} at {model.replicas} replicas (scale events: "
                       f"{events or 'none'}); instances seen: {seen or 'none'}")


async def load_step(url: str, client: RegistryClient, model: str, clients: int,
                    timeout: float = 300) -> StepResult:
    """Start `clients` closed-loop clients; time the scale-up until the new instance serves."""
    m = await client.get_model(name=model)
    first = set(await wait_running(client, m.id, 1))
    result, stop = StepResult(), asyncio.Event()
    async with aiohttp.ClientSession() as http:
        async def user() -> None:
            while not stop.is_set():
                async with http.post(f"{url}/v1/embeddings",
                                     json={"model": model, "input": [TEXT] * 8}) as r:
                    await r.read()
                    result.requests += r.status == 200

        start = time.monotonic()
        users = [asyncio.create_task(user()) for _ in range(clients)]
        try:
            while time.monotonic() - start < timeout and result.serving_s is None:
                now = time.monotonic() - start
                m = await client.get_model(name=model)
                if result.decided_s is None and m.replicas >= 2:
                    result.decided_s = now
                    result.reason = m.scale_events[-1].reason if m.scale_events else None
                running = await client.list_instances(InstanceFilter(
                    model_id=m.id, state=InstanceState.RUNNING))
                new = {i.id for i in running} - first
                if new and result.running_s is None:
                    result.running_s = now
                if new:
                    async with http.get(f"{url}/api/v1/loads") as r:
                        loads = (await r.json())["items"]
                    if any(x["instance_id"] in new and x["prompt_tokens"] > 0 for x in loads):
                        result.serving_s = now
                await asyncio.sleep(0.1)
        finally:
            stop.set()
            for u in users:
                u.cancel()
            await asyncio.gather(*users, return_exceptions=True)
    return result


@contextlib.asynccontextmanager
async def local_stack(root: Path) -> AsyncIterator[tuple[str, RegistryClient]]:
    """Embedded NATS + PostgreSQL and every service in this process."""
    from shoal.services.gateway.service import run_gateway
    from shoal.services.registry.service import run_registry
    from shoal.services.scheduler.replica import run_scheduler
    from shoal.services.worker.agent import run_worker
    from shoal.shared.bus.client import Bus
    from shoal.shared.config import Settings
    from shoal.shared.embedded import EmbeddedNats, EmbeddedPostgres, free_port

    nats = EmbeddedNats.start(root / "nats", port=None)
    pg = EmbeddedPostgres.start(root / "postgres")
    settings = Settings(nats_url=nats.url, database_url=pg.url, data_dir=root,
                        gateway_port=free_port(None), scheduler_interval=1.0,
                        scheduler_autoscale_interval=0.5, heartbeat_interval=1.0)
    stop, tasks = asyncio.Event(), []
    try:
        for run in (run_registry, run_scheduler, run_worker, run_gateway):
            ready = asyncio.Event()
            tasks.append(asyncio.create_task(run(settings, stop, ready)))
            await asyncio.wait_for(ready.wait(), 60)
        bus = await Bus.connect(settings, name="autoscale-step")
        try:
            yield f"http://127.0.0.1:{settings.gateway_port}", RegistryClient(bus)
        finally:
            await bus.close()
    finally:
        stop.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        pg.stop()
        nats.stop()


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="shoal-autoscale-") as tmp:
        async with local_stack(Path(tmp)) as (url, client), aiohttp.ClientSession() as http:
            name = f"minilm-{uuid.uuid4().hex[:6]}"
            async with http.post(f"{url}/api/v1/models", json={
                    "name": name, "source": str(minilm_path()), "device": "cpu",
                    "engine_args": {"max_num_seqs": 16, "num_threads": 1},
                    "autoscaling": AUTOSCALING}) as r:
                assert r.status == 201, await r.text()
            t0 = time.monotonic()
            m = await client.get_model(name=name)
            await wait_running(client, m.id, 1)
            print(f"first instance RUNNING after {time.monotonic() - t0:.1f}s; load step with "
                  f"{args.clients} clients")
            result = await load_step(url, client, name, args.clients)
    out = {"clients": args.clients, "autoscaling": AUTOSCALING, **result.__dict__}
    print(f"decision (replicas 1 -> 2) {result.decided_s:.1f}s after the step: {result.reason}")
    print(f"second instance RUNNING    {result.running_s:.1f}s")
    print(f"second instance serving    {result.serving_s:.1f}s  ({result.requests} requests "
          "answered meanwhile)")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / "autoscale_step.json"
    path.write_text(json.dumps(out, indent=2))
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--clients", type=int, default=8)
    asyncio.run(main_async(parser.parse_args()))


if __name__ == "__main__":
    main()
