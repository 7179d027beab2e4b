"""A worker agent stopped cleanly with SHOAL_WORKER_KEEP_ENGINES (an upgrade in place) in front of
a real SmolLM2 engine: it tells the registry it is leaving, so the worker is NOT_READY at once,
while the instance of the engine it left running stays RUNNING, untouched, and answers a chat;
the next agent adopts the engine (same pid) and the worker is READY again."""

from __future__ import annotations

import asyncio
import json
import uuid
from pathlib import Path

import openai
import psutil
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.services.worker.agent import run_worker
from shoal.services.worker.engines import end_engines_left
from shoal.shared.embedded import free_port
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import ModelCreate
from shoal.shared.states import WorkerState
from tests.e2e.test_serving import running_instance
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


async def _agent(settings: Settings) -> tuple[asyncio.Task[None], asyncio.Event]:
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(run_worker(settings, stop, ready))
    await asyncio.wait_for(ready.wait(), 30)
    return task, stop


async def test_engine_left_by_a_clean_stop_serves_on_and_is_adopted(servers,
                                                                     tmp_path: Path) -> None:
    settings = make_settings(servers, tmp_path / "data", namespace=f"cs{uuid.uuid4().hex[:8]}",
                             heartbeat_timeout=600.0, gateway_port=free_port(None))
    worker_settings = settings.model_copy(update={
        "worker_name": f"cs-{uuid.uuid4().hex[:6]}", "worker_keep_engines": True,
        "worker_labels": {"suite": "clean-stop"}})
    # clean: a model an earlier module left without a selector would be placed on this worker
    async with running_services(settings, gateway={}, name="clean-stop", clean=True) as stack:
        client = stack.client
        task, stop = await _agent(worker_settings)
        try:
            model = await client.create_model(ModelCreate(
                name=f"smol-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()),
                device="cpu", max_model_len=256, worker_selector={"suite": "clean-stop"},
                engine_args={"max_num_seqs": 2, "kv_cache_memory": 16 * 2**20}))
            serving = await running_instance(client, model.id)
            record = settings.data_dir / "engines" / f"{serving.id}.json"
            pid = int(json.loads(record.read_text())["pid"])

            stop.set()  # a clean stop, engines kept
            await task
            worker = await client.get_worker(serving.worker_id)  # told, not timed out
            assert worker.state is WorkerState.NOT_READY
            assert worker.state_message == "the worker agent stopped; 1 engine(s) left running"
            assert (await client.get_instance(serving.id)).version == serving.version
            assert psutil.pid_exists(pid)
            chat = openai.AsyncOpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
            answer = await chat.chat.completions.create(  # it serves without an agent
                model=model.name, max_tokens=4, messages=[{"role": "user", "content": "Hi"}])
            assert answer.choices[0].message.content is not None
            await chat.close()

            # the next agent (which stops its engines when it stops)
            task, stop = await _agent(worker_settings.model_copy(
                update={"worker_keep_engines": False}))
            assert (await client.get_worker(serving.worker_id)).state is WorkerState.READY
            assert (await client.get_instance(serving.id)).version == serving.version
            assert int(json.loads(record.read_text())["pid"]) == pid
        finally:
            stop.set()
            await task
            end_engines_left(settings.data_dir)  # none, unless the test failed midway
