"""`shoal serve HuggingFaceTB/SmolLM2-135M-Instruct` as a vLLM user types it, on a machine with no
hub: the model comes from a Hugging Face cache (laid out as huggingface_hub writes it) with
HF_HUB_OFFLINE=1, vLLM's flags are applied (--api-key, --max-num-seqs, --kv-cache-memory-bytes),
the console shows the instance's way to RUNNING, and /v1/models gives max_model_len as a number
(the model's own, none was given)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from shoal.services.engine import prepare_model, smollm2_gguf_path
from shoal.shared.embedded import free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
REPO = "HuggingFaceTB/SmolLM2-135M-Instruct"


def populate_hf_cache(root: Path) -> None:
    """The converted SmolLM2 folder as a cached hub snapshot: snapshots/<rev>/ + refs/main."""
    folder = prepare_model(str(smollm2_gguf_path()))
    snapshot = root / "models--HuggingFaceTB--SmolLM2-135M-Instruct" / "snapshots" / "e2e0rev"
    snapshot.mkdir(parents=True)
    for f in folder.iterdir():
        if f.is_file():
            shutil.copy(f, snapshot / f.name)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("e2e0rev")


def call(url: str, body: dict | None = None, key: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    req = urllib.request.Request(url, json.dumps(body).encode() if body else None, headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_serve_a_hub_id_from_the_cache_offline(tmp_path: Path) -> None:
    populate_hf_cache(tmp_path / "hf")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "HF_"))}
    env.update(SHOAL_HEARTBEAT_INTERVAL="1", HF_HUB_CACHE=str(tmp_path / "hf"),
               HF_HUB_OFFLINE="1")
    serve = subprocess.Popen(  # as vLLM users type it: flags after the model, several names
        [sys.executable, "-m", "shoal", "serve", REPO, "--port", str(port), "--api-key", "sekrit",
         "--max-num-seqs", "4", "--kv-cache-memory-bytes", str(64 * 2**20), "--seed", "1",
         "--served-model-name", "SmolLM2-135M-Instruct", "smol",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
         "--data-dir", str(tmp_path / "stack")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    try:
        assert serve.stdout is not None
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            line = serve.stdout.readline()
            if not line:
                break
            output.append(line)
            if "RUNNING as" in line:
                break
        text = "".join(output)
        assert "RUNNING as" in text, text
        assert f"deployed SmolLM2-135M-Instruct from {REPO}" in text
        assert "STARTING" in text  # the way there was shown

        base = f"http://127.0.0.1:{port}"
        for _ in range(40):  # the gateway hears the engine's first load within a moment
            status, models = call(f"{base}/v1/models", key="sekrit")
            assert status == 200
            entry, alias = models["data"]
            if entry["has_running_instance"] and entry["max_model_len"] is not None:
                break
            time.sleep(0.25)
        assert entry["id"] == "SmolLM2-135M-Instruct" and entry["max_model_len"] == 8192
        assert alias == {**entry, "id": "smol"}  # the second served name, same model
        assert (tmp_path / "stack" / "stack.json").exists()  # --data-dir after the model
        chat = {"model": "SmolLM2-135M-Instruct", "max_tokens": 8, "temperature": 0,
                "messages": [{"role": "user", "content": "What is the capital of France?"}]}
        assert call(f"{base}/v1/chat/completions", chat)[0] == 401
        status, reply = call(f"{base}/v1/chat/completions", chat, key="sekrit")
        assert status == 200 and reply["choices"][0]["message"]["content"]
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}]
        status, reply = call(f"{base}/v1/chat/completions",  # tools: "auto", a parser serves it
                             {**chat, "model": "smol", "tools": tools}, key="sekrit")
        assert status == 200 and reply["model"] == "SmolLM2-135M-Instruct", reply
    finally:
        serve.send_signal(signal.SIGINT)
        try:
            rest, _ = serve.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            serve.kill()
            rest, _ = serve.communicate()
        output.append(rest or "")
    assert serve.returncode == 0, "".join(output)


def test_serve_an_uncached_hub_id_offline_says_so(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "HF_"))}
    env.update(SHOAL_DATA_DIR=str(tmp_path / "stack"), HF_HUB_CACHE=str(tmp_path / "hf"),
               HF_ENDPOINT=f"http://127.0.0.1:{free_port()}")
    done = subprocess.run([sys.executable, "-m", "shoal", "serve", "org/not-cached"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "'org/not-cached' is not in the Hugging Face cache" in done.stderr
    assert "cannot be reached" in done.stderr
    assert not (tmp_path / "stack" / "stack.json").exists()  # nothing was started


async def test_serve_exits_with_the_reason_when_the_model_can_never_run_here(
        servers, tmp_path: Path) -> None:
    """`shoal serve` runs a stack of its own, one worker: a tp its only worker can never give
    (3 ranks, one core each, on a worker of 1 core) is not a PENDING forever but an exit with
    the scheduler's reason; a tp the heads cannot split is refused with the engine's rule."""
    from tests.integration.test_namespaces import _second_database

    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_DATA_DIR=str(tmp_path / "stack"), SHOAL_NATS_URL=servers.nats_url,
               SHOAL_DATABASE_URL=await _second_database(servers.database_url),
               SHOAL_WORKER_CPUS="[0]", SHOAL_HEARTBEAT_INTERVAL="1")
    smol = str(smollm2_gguf_path())
    for tp, reasons in (("3", ["can never be placed on this stack",
                               "tp=3 x pp=1 runs 3 engine ranks, one CPU core each"]),
                        ("2", ["tp=2 cannot work", "9 attention heads"])):
        done = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "shoal", "serve", smol,
                             "--tensor-parallel-size", tp, "--port", str(free_port())],
            env=env, capture_output=True, text=True, timeout=240)
        text = done.stdout + done.stderr
        assert done.returncode == 1, text
        for reason in reasons:
            assert reason in text, text
        assert "shoal: stopped" in done.stdout, text
        assert "deployed" not in done.stdout, text  # refused before anything was deployed
