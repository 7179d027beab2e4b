"""A pipeline-parallel instance served end to end on one worker: SmolLM2 deployed for CPU with
pp=2 runs two engine ranks (rank 1 a child process of rank 0's engine, not on the bus), answers
through the gateway with the `openai` SDK; SIGKILL of rank 1 mid-stream ends the stream with an
error, the instance goes to ERROR naming the rank, then RUNNING again with both ranks; deleting
the model leaves no rank process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import openai
import psutil
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import DeleteRequest, ModelCreate
from shoal.shared.states import InstanceState
from tests.e2e.test_serving import FRANCE, async_api, engine_pids, running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def rank_pids(engine_pid: int) -> list[int]:
    return [p.pid for p in psutil.Process(engine_pid).children()
            if "rank_process" in " ".join(p.cmdline())]


async def until(check, timeout: float = 120.0, what: str = ""):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = await check()
        if value:
            return value
        await asyncio.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}")


async def kill_mid_stream(api: openai.AsyncOpenAI, model: str, pid: int) -> float:
    """SIGKILL `pid` at the third chunk of a long stream, which must end with an error; the
    seconds the stream took."""
    stream = await api.completions.create(
        model=model, prompt="Count to one thousand:", max_tokens=300, temperature=0,
        stream=True, extra_body={"ignore_eos": True})
    received, started = 0, time.monotonic()
    with pytest.raises(openai.APIError):
        async for _ in stream:
            received += 1
            if received == 3:
                os.kill(pid, signal.SIGKILL)
    return time.monotonic() - started


async def test_pipeline_parallel_instance_serves_fails_by_rank_and_comes_back(
        servers, tmp_path_factory) -> None:
    settings = make_settings(servers, tmp_path_factory.mktemp("pp-e2e"), drain_timeout=5.0,
                             heartbeat_timeout=10.0, engine_restart_max_backoff=2.0,
                             gateway_engine_dead_after=2.0, gateway_port=free_port(None),
                             scheduler_interval=1.0)
    async with running_services(settings, worker={"worker_name": "pp-worker"}, gateway={},
                                name="pp-e2e", clean=True) as stack:
        client = stack.client
        model = await client.create_model(ModelCreate(
            name=f"smol-pp-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()),
            device="cpu", pp=2, max_model_len=512, worker_selector=stack.selector,
            engine_args={"max_num_seqs": 4, "kv_cache_memory": 32 * 2**20}))
        inst = await running_instance(client, model.id)
        assert (inst.tp, inst.pp) == (1, 2)
        [engine] = engine_pids(inst.id)
        ranks = rank_pids(engine)
        assert len(ranks) == 1  # rank 0 is the engine process itself
        api = async_api(f"http://127.0.0.1:{settings.gateway_port}")
        answer = await api.chat.completions.create(model=model.name, messages=FRANCE,
                                                   temperature=0, max_tokens=20)
        assert "Paris" in answer.choices[0].message.content

        assert await kill_mid_stream(api, model.name, ranks[0]) < 60

        async def errored():  # type: ignore[no-untyped-def]
            i = await client.get_instance(inst.id)
            return i if i.state is InstanceState.ERROR else None

        failed = await until(errored, what="ERROR")
        assert "rank 1 exited with code -9" in (failed.state_message or "")
        back = await running_instance(client, model.id)
        [engine2] = engine_pids(back.id)
        assert engine2 != engine and len(rank_pids(engine2)) == 1
        # RUNNING in the registry: the gateway routes to the new engine at once, no 503
        again = await api.chat.completions.create(model=model.name, messages=FRANCE,
                                                  temperature=0, max_tokens=20)
        assert "Paris" in again.choices[0].message.content

        survivors = [engine2, *rank_pids(engine2)]
        await client.delete_model(DeleteRequest(id=model.id))

        async def all_gone():  # type: ignore[no-untyped-def]
            return not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                           for p in survivors)

        await until(all_gone, 60, "every rank to stop")
