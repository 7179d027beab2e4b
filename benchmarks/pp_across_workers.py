"""PP=2 across two worker agents vs PP=2 in one worker, in one run, through the gateway.

Starts `shoal up --no-model` on a fresh data dir (its worker labelled role=solo, on every core)
and two more agents labelled role=stage, each on one core (SHOAL_WORKER_CPUS, so the agents'
engines do not oversubscribe the cores: a first run without it had rank 0 and rank 1 each run 2
threads on 2 cores, 4x slower). SmolLM2 is deployed twice for CPU with `--pp 2`: on the solo
worker (both stages there: rank 1 a child of rank 0's engine, one core each) and on the stage
workers, where neither alone has a core per stage, so the scheduler puts one stage on each
(rank 1 started by the other agent from the plan rank 0 publishes on NATS). Then alternates
rounds of the same workload against each (N greedy completions,
ignore_eos, fixed lengths, a concurrency cap) and reports output tokens/s per round and the
median ratio across/one. Both agents run on this machine, so the stage hand-off is loopback TCP
either way: the figure is the cost of the control plane and of the rank living under another
agent, not of a network.

    .venv/bin/python -m benchmarks.pp_across_workers [--rounds 3] [--requests 8] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a long story about a river city and its history:"


def shoal(env: dict[str, str], *args: str, timeout: float = 600) -> str:
    return subprocess.run([sys.executable, "-m", "shoal", *args], env=env, check=True,
                          capture_output=True, text=True, timeout=timeout).stdout


async def one_round(base_url: str, model: str, requests: int, max_tokens: int,
                    concurrency: int) -> dict[str, float]:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0,
                             timeout=600)
    gate = asyncio.Semaphore(concurrency)
    retries: list[str] = []

    async def one() -> int:
        async with gate:
            for attempt in range(5):  # a 503 on a loaded machine (an engine's load message late)
                try:
                    out = await api.completions.create(
                        model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                        extra_body={"ignore_eos": True})
                    return out.usage.completion_tokens if out.usage else 0
                except openai.APIStatusError as exc:
                    if exc.status_code != 503 or attempt == 4:
                        raise
                    retries.append(model)
                    await asyncio.sleep(2)
            return 0

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one() for _ in range(requests))))
    seconds = time.perf_counter() - start
    await api.close()
    return {"output_tokens": tokens, "seconds": seconds, "output_tok_s": tokens / seconds,
            "retried_503": len(retries)}


async def until_answers(base_url: str, model: str, timeout: float = 120) -> None:
    import openai

    api = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="none", max_retries=0)
    deadline = time.monotonic() + timeout
    while True:
        try:
            await api.completions.create(model=model, prompt="Hi", max_tokens=2)
            await api.close()
            return
        except openai.APIError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=4)
    args = parser.parse_args()

    from shoal.services.engine.model_prep import smollm2_gguf_path
    from shoal.shared.embedded import free_port

    data_dir = Path(tempfile.mkdtemp(prefix="shoal-pp-workers-"))
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHOAL_")}
    env.update(SHOAL_DATA_DIR=str(data_dir), SHOAL_GATEWAY_PORT=str(port),
               SHOAL_HEARTBEAT_INTERVAL="1", SHOAL_DISTRIBUTED_HOST="127.0.0.1")
    base_url = f"http://127.0.0.1:{port}"
    up = subprocess.Popen([sys.executable, "-m", "shoal", "up", "--no-model"],
                          env=dict(env, SHOAL_WORKER_LABELS='{"role": "solo"}'),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    agents: list[subprocess.Popen[bytes]] = []
    try:
        assert up.stdout is not None
        for line in up.stdout:
            if "shoal: ready" in line:
                break
        else:
            raise SystemExit("shoal up did not get ready")
        for core in (0, 1):
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "shoal", "worker", "--name", f"stage{core}", "--label",
                 "role=stage"], env=dict(env, SHOAL_WORKER_CPUS=f"[{core}]"),
                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 90
        while len([w for w in json.loads(shoal(env, "workers", "list", "--json"))
                   if w["state"] == "READY"]) < 3:
            if time.monotonic() > deadline:
                raise SystemExit("the stage workers did not get READY")
            time.sleep(1)
        gguf = str(smollm2_gguf_path())
        common = ["--source", gguf, "--device", "cpu", "--pp", "2", "--max-model-len", "1024",
                  "--engine-arg", "kv_cache_memory=67108864", "--wait"]
        shoal(env, "models", "deploy", "pp-one-worker", *common, "--worker-selector",
              "role=solo")
        shoal(env, "models", "deploy", "pp-two-workers", *common, "--worker-selector",
              "role=stage")
        instances = json.loads(shoal(env, "instances", "list", "--json"))
        placement = {i["model_name"]: [i["worker_name"]]
                     + [s["worker_name"] for s in i["subordinate_workers"]] for i in instances}
        assert len(placement["pp-one-worker"]) == 1 and len(placement["pp-two-workers"]) == 2, \
            placement
        asyncio.run(until_answers(base_url, "pp-one-worker"))
        asyncio.run(until_answers(base_url, "pp-two-workers"))
        rounds: dict[str, list[dict[str, float]]] = {"pp-one-worker": [], "pp-two-workers": []}
        asyncio.run(one_round(base_url, "pp-one-worker", 2, 8, 2))  # warm-up
        asyncio.run(one_round(base_url, "pp-two-workers", 2, 8, 2))
        for _ in range(args.rounds):
            for model in rounds:
                rounds[model].append(asyncio.run(one_round(
                    base_url, model, args.requests, args.max_tokens, args.concurrency)))
        ratios = [b["output_tok_s"] / a["output_tok_s"]
                  for a, b in zip(rounds["pp-one-worker"], rounds["pp-two-workers"], strict=True)]
        report = {
            "benchmark": "pp_across_workers", "placement": placement,
            "workload": {"requests": args.requests, "max_tokens": args.max_tokens,
                         "concurrency": args.concurrency, "rounds": args.rounds},
            "rounds": rounds, "ratio_two_over_one_per_round": ratios,
            "median_ratio": statistics.median(ratios),
            "load_average": os.getloadavg(), "cpus": os.cpu_count(),
            "machine": platform.machine(),
        }
        print(json.dumps(report, indent=2))
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"pp_across_workers-{time.strftime('%Y%m%dT%H%M%S')}.json"
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
    finally:
        for proc in (*agents, up):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
