"""The worker agent SIGKILLed again and again under streaming load (a real `shoal up` stack
serving SmolLM2): its engine is adopted every time, and nothing the gateway serves notices.

A targeted, faster companion of test_chaos.py for the agent alone: the adopted instance must
stay RUNNING at one version-free view of it (every state the registry shows between kills is
RUNNING), the engine keeps its pid, and no stream ends with an error event.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import openai
import psutil
import pytest

from shoal.shared.embedded import free_port
from tests.e2e.stack_waits import only_worker, wait_model_served, wait_registered_again

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MODEL = "SmolLM2-135M-Instruct"
KILLS = 2
"""The first kill takes the agent that started the engine, the second one that had adopted it
(an adopted engine adopted again); a third would repeat the second."""
STREAMS = 2


def _agent_pid(up: subprocess.Popen[str]) -> int | None:
    for child in psutil.Process(up.pid).children():
        try:
            argv = child.cmdline()
        except psutil.Error:
            continue
        if argv[-1:] == ["worker"] or argv[3:4] == ["worker"]:
            return child.pid
    return None


def _engine(data_dir: Path) -> tuple[str, int]:
    (record,) = (data_dir / "engines").glob("*.json")
    return record.stem, int(json.loads(record.read_text())["pid"])


async def _chats(client: openai.AsyncOpenAI, errors: list[str], done: list[int],
                 stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            stream = await client.chat.completions.create(
                model=MODEL, stream=True, max_tokens=16, temperature=0,
                messages=[{"role": "user", "content": "Name a colour."}])
            async for _chunk in stream:
                pass
            done.append(1)
        except openai.APIError as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
            await asyncio.sleep(0.2)


async def _watch(http: aiohttp.ClientSession, url: str, seen: list[str],
                 stop: asyncio.Event) -> None:
    """Every state the registry shows for the instance, in order (repeats folded)."""
    while not stop.is_set():
        try:
            async with http.get(url) as resp:
                if resp.status == 200:
                    body = await resp.json()
                    state = f"{body['state']}: {body.get('state_message')}"
                    if not seen or seen[-1] != state:
                        seen.append(state)
        except (aiohttp.ClientError, TimeoutError):
            pass
        await asyncio.sleep(0.05)


async def test_agent_sigkilled_repeatedly_never_disturbs_its_engine(tmp_path: Path) -> None:
    data_dir, port = tmp_path / "stack", free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_DATA_DIR=str(data_dir), SHOAL_GATEWAY_PORT=str(port),
               SHOAL_HEARTBEAT_INTERVAL="1", SHOAL_GATEWAY_ENGINE_DEAD_AFTER="10")
    log_path = tmp_path / "up.log"
    out = log_path.open("w")
    up = subprocess.Popen([sys.executable, "-m", "shoal", "up"], env=env, stdout=out,
                          stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                                timeout=30)
    http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10))
    stop = asyncio.Event()
    tasks: list[asyncio.Task[None]] = []
    try:
        await wait_model_served(http, base, MODEL, 300, alive=lambda: up.poll() is None,
                                context=lambda: log_path.read_text()[-3000:])
        instance_id, engine_pid = _engine(data_dir)
        errors: list[str] = []
        done: list[int] = []
        seen: list[str] = []
        tasks = [asyncio.create_task(_chats(client, errors, done, stop)) for _ in range(STREAMS)]
        tasks.append(asyncio.create_task(
            _watch(http, f"{base}/api/v1/instances/{instance_id}", seen, stop)))
        await asyncio.sleep(1)
        for _ in range(KILLS):
            agent = _agent_pid(up)
            assert agent is not None
            worker = await only_worker(http, base)
            os.kill(agent, signal.SIGKILL)
            # until shoal up has started a new agent and it has adopted the engine
            await wait_registered_again(http, base, worker, 60)
            await asyncio.sleep(4)  # a few reconciles and heartbeats of the new agent
        served = len(done)
        await asyncio.sleep(1)
        stop.set()
        await asyncio.wait_for(asyncio.gather(*tasks), 40)
        assert _engine(data_dir) == (instance_id, engine_pid) and psutil.pid_exists(engine_pid)
        assert [s.split(":")[0] for s in seen] == ["RUNNING"], seen
        assert not errors, errors[:5]
        assert served > 0 and len(done) > served  # the load ran, and ran on after the kills
    finally:
        stop.set()
        for task in tasks:
            task.cancel()
        await http.close()
        await client.close()
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
        out.close()
