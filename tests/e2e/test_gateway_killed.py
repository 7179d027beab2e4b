"""A gateway SIGKILLed while it streams (issue 32, item 5): its engine stops the requests whose
requester vanished within seconds (it does not go on generating for clients that are gone), and
the usage of what was delivered reaches the registry anyway, recorded by the engine, once per
request; a gateway that is alive and drops a stream (its client left) records the usage itself,
and the engine does not record it again.

Real processes: registry, scheduler and worker in this process, SmolLM2's engine under the
worker, the gateway as a child process of its own (the one killed), streams read with aiohttp.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import aiohttp
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.bus.client import Bus
from shoal.shared.embedded import free_port
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyScope, KeyLimit, ModelCreate, UsageQuery
)
from tests.e2e.test_serving import running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
STREAMS = 8
MAX_TOKENS = 400
STOPPED_BOUND_S = 20.0
"""From the kill until the engine runs no request (0.5 s measured; the design says a few
seconds, and a two-core machine under a load of 30 gets slack: undisturbed, the streams would
run for minutes)."""


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("gateway-killed"),
                             drain_timeout=5.0, heartbeat_timeout=30.0, scheduler_interval=1.0,
                             request_timeout=20.0)
    tag = uuid.uuid4().hex[:6]
    async with running_services(settings, worker={"worker_name": f"real-{tag}",
                                                  "worker_labels": {"stack": tag}},
                                name="gateway-killed", clean=True) as stack:
        model = await stack.client.create_model(ModelCreate(
            name=f"smol-{tag}", source=str(smollm2_gguf_path()), device="cpu", max_model_len=512,
            worker_selector={"stack": tag},
            engine_args={"max_num_seqs": STREAMS, "kv_cache_memory": 128 * 2**20}))
        inst = await running_instance(stack.client, model.id)
        yield stack, model.name, inst.id


def start_gateway(stack, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port(None)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_NATS_URL=stack.settings.nats_url, SHOAL_NAMESPACE=stack.settings.ns,
               SHOAL_DATABASE_URL=stack.settings.database_url,
               SHOAL_DATA_DIR=str(stack.settings.data_dir), SHOAL_GATEWAY_PORT=str(port),
               SHOAL_REQUIRE_API_KEY="true")
    proc = subprocess.Popen([sys.executable, "-m", "shoal", "gateway"], env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(http: aiohttp.ClientSession, url: str, proc, log: Path) -> None:
    for _ in range(300):
        assert proc.poll() is None, f"the gateway exited (its log: {log})"
        try:
            async with http.get(f"{url}/health") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise AssertionError("the gateway never answered /health")


class Stream:
    """One streamed chat read event by event: the completion tokens the client received (the
    continuous usage on each chunk) and its prompt's tokens."""

    def __init__(self) -> None:
        self.output_tokens = self.prompt_tokens = 0
        self.started = asyncio.Event()

    async def run(self, http: aiohttp.ClientSession, url: str, key: str, model: str,
                  min_tokens: int = 5, stop_after: int | None = None) -> None:
        body = {"model": model, "stream": True, "max_tokens": MAX_TOKENS, "ignore_eos": True,
                "temperature": 0, "messages": [{"role": "user", "content": "Count to 500."}],
                "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
        try:
            async with http.post(f"{url}/v1/chat/completions", json=body,
                                 headers={"Authorization": f"Bearer {key}"}) as r:
                assert r.status == 200, await r.text()
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    usage = json.loads(line[6:]).get("usage")
                    if usage:
                        self.prompt_tokens = usage["prompt_tokens"]
                        self.output_tokens = usage["completion_tokens"]
                    if self.output_tokens >= min_tokens:
                        self.started.set()
                    if stop_after is not None and self.output_tokens >= stop_after:
                        return  # the client leaves: the connection closes
        except (aiohttp.ClientError, asyncio.IncompleteReadError):
            pass  # the gateway died under it


async def latest_load(bus: Bus, instance_id: str) -> EngineLoad:
    msg = await bus.nc.subscribe(bus.subjects.load(instance_id), max_msgs=1)
    try:
        return EngineLoad.model_validate_json((await msg.next_msg(timeout=5)).data)
    finally:
        await msg.unsubscribe()


async def usage_of(stack, key_id: str) -> tuple[int, int, int]:
    rows = (await stack.client.usage(UsageQuery(key_id=key_id))).rows
    return (sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
            sum(r.output_tokens for r in rows))


async def test_a_killed_gateway_stops_its_streams_and_keeps_their_usage(
        stack, tmp_path: Path) -> None:
    stack, model, instance_id = stack
    # half the streams on a key with limits (a reservation the engine's record settles), half
    # on one without (usage the gateway would have batched)
    keys = [await stack.client.create_key(ApiKeyCreate(
        name=f"k{i}-{uuid.uuid4().hex[:6]}", scope=ApiKeyScope.INFERENCE,
        limits=[KeyLimit(token_budget=10**7)] if i == 0 else [])) for i in range(2)]
    log = tmp_path / "gateway.log"
    gateway, url = start_gateway(stack, log)
    async with aiohttp.ClientSession() as http:
        try:
            await wait_healthy(http, url, gateway, log)
            streams = [Stream() for _ in range(STREAMS)]
            tasks = [asyncio.create_task(s.run(http, url, keys[i % 2].secret, model))
                     for i, s in enumerate(streams)]
            await asyncio.wait_for(asyncio.gather(*(s.started.wait() for s in streams)), 300)
            assert (await latest_load(stack.bus, instance_id)).num_running == STREAMS
            gateway.send_signal(signal.SIGKILL)
            killed_at = time.monotonic()
            gateway.wait(10)
            at_kill = (await latest_load(stack.bus, instance_id)).generation_tokens
            await asyncio.gather(*tasks)
            delivered = {i: sum(s.output_tokens for s in streams[i::2]) for i in range(2)}

            while (load := await latest_load(stack.bus, instance_id)).num_running:
                assert time.monotonic() - killed_at < STOPPED_BOUND_S, load
                await asyncio.sleep(0.1)
            after = load.generation_tokens - at_kill  # what the engine made for nobody
            print(f"engine idle {time.monotonic() - killed_at:.1f}s after the kill; "
                  f"{after} tokens generated after it; delivered {delivered}")
            left = STREAMS * MAX_TOKENS - sum(delivered.values())
            assert after < left / 4, (after, left)

            for i, key in enumerate(keys):  # the engine's records reach the registry
                for _ in range(100):
                    requests, prompt, output = await usage_of(stack, key.id)
                    if requests == STREAMS // 2:
                        break
                    await asyncio.sleep(0.1)
                assert requests == STREAMS // 2, (i, requests)
                assert prompt == sum(s.prompt_tokens for s in streams[i::2]) > 0
                # what the client read, plus what was in flight in the gateway when it died
                assert delivered[i] <= output <= delivered[i] + after + STREAMS * 8, (
                    i, output, delivered[i])
        finally:
            if gateway.poll() is None:
                gateway.kill()

        # A live gateway whose client leaves records that request once (the engine, which
        # hears the abort before the inbox goes, records nothing).
        gateway, url = start_gateway(stack, log)
        try:
            await wait_healthy(http, url, gateway, log)
            before = await usage_of(stack, keys[1].id)
            leaver = Stream()
            await leaver.run(http, url, keys[1].secret, model, stop_after=10)
            for _ in range(100):
                if (await usage_of(stack, keys[1].id))[0] > before[0]:
                    break
                await asyncio.sleep(0.1)
            await asyncio.sleep(3)  # past the engine's grace: a second record would be here
            requests, _, output = await usage_of(stack, keys[1].id)
            assert requests == before[0] + 1
            assert leaver.output_tokens <= output - before[2] < leaver.output_tokens + 40
        finally:
            gateway.send_signal(signal.SIGTERM)
            gateway.wait(30)
