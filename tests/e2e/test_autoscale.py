"""Autoscaling on the real stack (registry, scheduler, a real worker starting engine processes,
gateway) with all-MiniLM-L6-v2: an idle model scales to zero, the first request then waits while
an instance starts and is answered (the openai SDK), and a load step scales it up to a second
instance that serves; each decision is kept on the model with its reason. The same load step,
timed, is loadtests/autoscale_step.py (docs/figures.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import aiohttp
import openai
import pytest

from loadtests.autoscale_step import load_step, wait_running
from shoal.services.engine.model_prep import minilm_path, smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest, InstanceFilter
from tests.e2e.test_embeddings_serving import async_api
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
AUTOSCALING = {"min_replicas": 0, "max_replicas": 2, "target": 1.0, "scale_to_zero_after": 3,
               "scale_up_cooldown": 0, "scale_down_cooldown": 60}


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("autoscale-e2e"), drain_timeout=2.0,
                             heartbeat_timeout=10.0, gateway_engine_dead_after=5.0,
                             gateway_port=free_port(None), scheduler_interval=1.0,
                             scheduler_autoscale_interval=0.5, gateway_cold_start_timeout=120.0)
    tag = uuid.uuid4().hex[:6]
    worker = {"worker_name": f"real-{tag}", "worker_labels": {"stack": tag}}
    async with running_services(settings, worker=worker, gateway={}, name="autoscale-e2e",
                                clean=True) as stack:
        try:
            yield stack.url, stack.client, tag
        finally:
            for leftover in await stack.client.list_models():
                await stack.client.delete_model(DeleteRequest(id=leftover.id))


async def test_scale_to_zero_then_from_zero_then_up(stack) -> None:
    url, client, tag = stack
    name = f"minilm-{tag}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/api/v1/models", json={
                "name": name, "source": str(minilm_path()), "device": "cpu",
                "worker_selector": {"stack": tag}, "autoscaling": AUTOSCALING,
                "engine_args": {"max_num_seqs": 16, "num_threads": 1}}) as r:
            assert r.status == 201, await r.text()
            model = await r.json()
    assert model["replicas"] == 1  # within [min, max]
    await wait_running(client, model["id"], 1)

    # idle for scale_to_zero_after: no instance left
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = await client.get_model(name=name)
        if m.replicas == 0 and not await client.list_instances(InstanceFilter(model_id=m.id)):
            break
        await asyncio.sleep(0.5)
    else:
        raise AssertionError(f"not scaled to zero: {m.replicas} replicas")
    assert m.scale_events[-1].reason.startswith("scale to zero: idle for")
    assert (m.scale_events[-1].from_replicas, m.scale_events[-1].to_replicas) == (1, 0)

    # the first request waits while an instance starts, and is answered
    start = time.monotonic()
    out = await async_api(url).embeddings.create(model=name, input="hello again")
    cold = time.monotonic() - start
    assert len(out.data[0].embedding) == 384
    m = await client.get_model(name=name)
    assert m.replicas == 1 and m.scale_events[-1].reason.startswith("scale from zero")
    print(f"\ncold start (scale from zero to an answer): {cold:.1f}s")

    # a load step: requests wait in the engine's queue, a second instance starts and serves
    result = await load_step(url, client, name, clients=8, timeout=240)
    assert result.serving_s is not None and result.reason is not None
    assert result.reason.startswith("scale up:")
    assert "waiting requests per instance" in result.reason
    m = await client.get_model(name=name)
    assert m.replicas == 2
    print(f"load step -> decision {result.decided_s:.1f}s, RUNNING {result.running_s:.1f}s, "
          f"serving {result.serving_s:.1f}s")


async def test_kv_cache_usage_target_scales_up(stack) -> None:
    """The kv_cache_usage metric on the real stack: SmolLM2 with a small KV cache, long streamed
    chats fill it past the target, and the leader scales the model up saying so (the new
    replica's start is not waited for: the load step above times one)."""
    url, client, tag = stack
    name = f"smol-kv-{tag}"
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/api/v1/models", json={
                "name": name, "source": str(smollm2_gguf_path()), "device": "cpu",
                "max_model_len": 256, "worker_selector": {"stack": tag},
                "autoscaling": {"min_replicas": 1, "max_replicas": 2,
                                "metric": "kv_cache_usage", "target": 0.2,
                                "scale_up_cooldown": 0, "scale_down_cooldown": 600},
                "engine_args": {"max_num_seqs": 4, "kv_cache_memory": 16 * 2**20}}) as r:
            assert r.status == 201, await r.text()
            model = await r.json()
    await wait_running(client, model["id"], 1)
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    stop = asyncio.Event()

    async def chat() -> None:
        while not stop.is_set():
            with contextlib.suppress(openai.APIError):
                stream = await api.chat.completions.create(
                    model=name, stream=True, max_tokens=150, temperature=0.8, messages=[
                        {"role": "user", "content": "Write a long story about the sea."}])
                async for _chunk in stream:
                    pass

    users = [asyncio.create_task(chat()) for _ in range(3)]
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            m = await client.get_model(name=name)
            if m.replicas == 2:
                break
            await asyncio.sleep(0.5)
        else:
            raise AssertionError(f"not scaled up on KV-cache use: {m.scale_events}")
    finally:
        stop.set()
        await asyncio.gather(*users, return_exceptions=True)
        await api.close()
        await client.delete_model(DeleteRequest(id=model["id"]))
    reason = m.scale_events[-1].reason
    assert reason.startswith("scale up: KV-cache use") and "(target 20%)" in reason, reason
    assert (m.scale_events[-1].from_replicas, m.scale_events[-1].to_replicas) == (1, 2)
