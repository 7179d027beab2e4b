"""Mid-stream failover (issue 32, item 3): two replicas of SmolLM2 on a real worker, a greedy
streamed chat through the gateway, and the engine serving it SIGKILLed mid-stream. The stream
goes on on the other replica: the client's text and tokens are those of an undisturbed run, its
usage the original request's, and shoal:gateway_stream_failovers counts the move."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import uuid

import aiohttp
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.errors import Timeout, Unavailable
from shoal.shared.schemas.registry import InstanceFilter, ModelCreate
from shoal.shared.states import InstanceState
from tests.e2e.test_engine_serving import engine_pids
from tests.e2e.test_gateway_killed import latest_load
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
KILL_AFTER_TOKENS = 15
BODY = {"stream": True, "max_tokens": 80, "ignore_eos": True, "temperature": 0,
        "logprobs": True, "top_logprobs": 1,
        "messages": [{"role": "user", "content": "Count from one to one hundred in words."}],
        "stream_options": {"include_usage": True}}


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("failover"), drain_timeout=5.0,
                             heartbeat_timeout=10.0, scheduler_interval=1.0,
                             engine_restart_max_backoff=2.0, request_timeout=20.0)
    tag = uuid.uuid4().hex[:6]
    async with running_services(settings, worker={"worker_name": f"real-{tag}",
                                                  "worker_labels": {"stack": tag}},
                                gateway={}, name="failover", clean=True) as stack:
        model = await stack.client.create_model(ModelCreate(
            name=f"smol-{tag}", source=str(smollm2_gguf_path()), device="cpu", max_model_len=512,
            replicas=2, worker_selector={"stack": tag},
            engine_args={"max_num_seqs": 4, "kv_cache_memory": 64 * 2**20, "num_threads": 1}))
        deadline, running = time.monotonic() + 600, []
        while len(running) < 2:
            assert time.monotonic() < deadline, "two replicas never ran"
            await asyncio.sleep(1)
            with contextlib.suppress(Timeout, Unavailable):  # a registry slow on a busy machine
                running = await stack.client.list_instances(InstanceFilter(
                    model_id=model.id, state=InstanceState.RUNNING))
        yield stack, model.name, [i.id for i in running]


class Stream:
    def __init__(self) -> None:
        self.text, self.tokens, self.usage, self.errors = "", [], None, []
        self.num_tokens = 0

    async def run(self, http: aiohttp.ClientSession, url: str, model: str) -> None:
        async with http.post(f"{url}/v1/chat/completions", json={**BODY, "model": model}) as r:
            assert r.status == 200, await r.text()
            async for line in r.content:
                if not line.startswith(b"data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    self.errors.append(event["error"])
                    continue
                self.usage = event.get("usage") or self.usage
                for choice in event["choices"]:
                    self.text += choice["delta"].get("content") or ""
                    for lp in (choice.get("logprobs") or {}).get("content") or []:
                        self.tokens.append(lp["token"])
                        self.num_tokens += 1


async def serving(stack, instances: list[str]) -> str:
    """The instance whose engine runs a request now."""
    while True:
        for instance_id in instances:
            if (await latest_load(stack.bus, instance_id)).num_running:
                return instance_id
        await asyncio.sleep(0.05)


async def test_a_greedy_stream_survives_its_engine(stack) -> None:
    stack, model, instances = stack
    async with aiohttp.ClientSession() as http:
        calm = Stream()
        await calm.run(http, stack.url, model)
        assert calm.num_tokens == 80 and not calm.errors

        moved = Stream()
        task = asyncio.create_task(moved.run(http, stack.url, model))
        while moved.num_tokens < KILL_AFTER_TOKENS:
            await asyncio.sleep(0.02)
        victim = await serving(stack, instances)
        (pid,) = engine_pids(victim)
        os.kill(pid, signal.SIGKILL)
        cut_at = moved.num_tokens
        await asyncio.wait_for(task, 180)
        assert cut_at < 80, "the stream ended before the kill"
        assert not moved.errors, moved.errors
        assert moved.text == calm.text and moved.tokens == calm.tokens
        # the original prompt once, every token delivered (cache hits are the last engine's)
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [moved.usage[k] for k in counts] == [calm.usage[k] for k in counts]
        print(f"killed {victim} after {cut_at} tokens; the stream went on, {moved.num_tokens} "
              f"tokens, text equal to the undisturbed run's")

        async with http.get(f"{stack.url}/metrics") as r:
            metrics = await r.text()
        line = f'shoal:gateway_stream_failovers_total{{model_name="{model}",outcome="resumed"}}'
        assert f"{line} 1.0" in metrics, [m for m in metrics.splitlines() if "failover" in m]
