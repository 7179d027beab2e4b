"""Served against offline on the same model, same run (issue 31 item 6): the whole stack
(`shoal serve MODEL`, i.e. `shoal up` plus that one model: embedded NATS and PostgreSQL,
registry, scheduler, worker, engine process, gateway) with its own data dir, gateway port and
NATS namespace, against `shoal.LLM` in this process on the same folder and engine settings.

Workloads, fixed lengths (`ignore_eos`): a single stream (`--single` requests one after another)
and `--concurrency` (32) requests at once, each `--output-len` tokens; rounds alternate which
side goes first. Reported: output tok/s served / offline (target >= 0.95) at both, and the time
to first token the cluster path adds at concurrency 1 (target < 5 ms), two ways: served median
TTFT - offline's (swamped by the machine's pace: the prefill alone moves by 20 ms between
minutes on the 2-core build machine), and per request the client's TTFT less that request's
own queue + prefill in the engine (arrival -> first token, the engine's RequestMetrics; served:
read from the engine's vllm:request_queue/prefill_time_seconds sums after each request of the
single stream, which runs one request at a time), median over the requests; offline likewise,
for the same-run comparison. Streaming completions over HTTP are timed as
loadtests/serving.py times them.

    .venv/bin/python -m loadtests.served_offline [--model-path 1b|FOLDER] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from loadtests.serving import (RESULTS, Result, Sample, WORDS, one_request, run_offline,
                               run_served, summarize)

NAME = "bench-model"


def samples(count: int, output_len: int, seed: int, words: int = 32) -> list[Sample]:
    import random

    rng = random.Random(seed)
    return [Sample(" ".join(rng.choice(WORDS) for _ in range(words)), words, output_len)
            for _ in range(count)]


def start_stack(folder: str, root: Path, port: int, args: argparse.Namespace
                ) -> subprocess.Popen[str]:
    """`shoal serve` with its own data dir, gateway port and NATS namespace."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOAL_", "OTEL_"))}
    env.update(SHOAL_DATA_DIR=str(root / "stack"), SHOAL_GATEWAY_PORT=str(port),
               SHOAL_NAMESPACE=f"bench{uuid.uuid4().hex[:8]}")
    if args.served_threads:  # an explicit count: the served engine's contention guard is off
        env["OMP_NUM_THREADS"] = str(args.served_threads)
    cmd = [sys.executable, "-m", "shoal", "serve", folder, "--served-model-name", NAME,
           "--port", str(port), "--dtype", args.dtype,
           "--kv-cache-memory-bytes", str(args.kv_cache_memory), "--seed", "0"]
    log = (root / "serve.log").open("w")
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)


async def wait_served(url: str, proc: subprocess.Popen[str], timeout: float) -> str:
    """"" once the gateway routes to the model, else why not (the stack exited, or the time)."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                return "shoal serve exited"
            try:
                async with http.get(f"{url}/v1/models") as resp:
                    cards = (await resp.json()).get("data", []) if resp.status == 200 else []
                if any(c["id"] == NAME and c.get("has_running_instance") for c in cards):
                    return ""
            except (aiohttp.ClientError, ValueError):
                pass
            await asyncio.sleep(1.0)
    return f"{NAME} not served after {timeout:.0f} s"


ENGINE_TIMES = ("vllm:request_queue_time_seconds_sum", "vllm:request_prefill_time_seconds_sum")


async def engine_metrics_url(url: str) -> str:
    """The engine's own /metrics, found through the gateway's /metrics/targets."""
    import aiohttp

    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/metrics/targets") as resp:
            groups = await resp.json()
    engines = [g["targets"][0] for g in groups if g["labels"].get("shoal_service") == "engine"]
    if len(engines) != 1:
        raise SystemExit(f"expected one engine among the metrics targets, got {groups}")
    return f"http://{engines[0]}/metrics"


def engine_seconds(text: str) -> tuple[float, float]:
    """The engine's (queue, prefill) seconds over every request so far (its histograms' sums)."""
    sums = [0.0, 0.0]
    for line in text.splitlines():
        for i, name in enumerate(ENGINE_TIMES):
            if line.startswith(name):
                sums[i] += float(line.rsplit(" ", 1)[1])
    return sums[0], sums[1]


def stack_cpu_seconds(root_pid: int) -> tuple[float, float]:
    """(CPU seconds of the stack's processes but its engine, plus this process's (the client);
    the engine's): what the engine's contention guard counts as other processes on a machine
    with nothing else running, and the engine's own."""
    tick = os.sysconf("SC_CLK_TCK")
    parents, cpu, engines = {}, {}, set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        rest = stat[stat.rindex(b")") + 2:].split()
        pid = int(entry.name)
        parents[pid] = int(rest[1])
        cpu[pid] = (int(rest[11]) + int(rest[12])) / tick
        if cmdline[1:4] == [b"-m", b"shoal", b"engine"]:
            engines.add(pid)

    def in_stack(pid: int) -> bool:
        while pid > 1:
            if pid == root_pid:
                return True
            pid = parents.get(pid, 0)
        return False

    stack = [pid for pid in cpu if in_stack(pid)]
    own = sum(os.times()[:2])
    return (own + sum(cpu[p] for p in stack if p not in engines),
            sum(cpu[p] for p in stack if p in engines))


async def run_single_served(url: str, metrics_url: str, work: list[Sample], stack_pid: int = 0
                            ) -> tuple[list[Result], float]:
    """One request at a time; after each, the engine's queue + prefill sums, whose growth is
    that request's own (nothing else runs). The seconds returned leave the scrapes out. With
    stack_pid, prints the cores the rest of the stack and the client kept busy meanwhile
    (the engine's contention guard gives a thread up only for 0.75 of a core)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    results, seconds = [], 0.0
    cpu_before, wall_before = (stack_cpu_seconds(stack_pid) if stack_pid else (0.0, 0.0),
                               time.perf_counter())
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def scrape() -> tuple[float, float]:
            async with session.get(metrics_url) as resp:
                return engine_seconds(await resp.text())

        before = await scrape()
        for sample in work:
            began = time.perf_counter()
            res = await one_request(session, url, NAME, sample)
            seconds += time.perf_counter() - began
            after = await scrape()
            res.engine_queue = after[0] - before[0]
            res.engine_ttft, before = sum(after) - sum(before), after
            results.append(res)
    if stack_pid:
        wall, (others, engine) = time.perf_counter() - wall_before, stack_cpu_seconds(stack_pid)
        print(f"  the stack but its engine, and the client, kept "
              f"{(others - cpu_before[0]) / wall:.2f} cores busy over {wall:.1f} s (the engine "
              f"{(engine - cpu_before[1]) / wall:.2f})", flush=True)
    return results, seconds


def offline_run(llm: Any, work: list[Sample], conc: int) -> tuple[list[Result], float]:
    return run_offline("", work, conc, {}, llm=llm)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", default="1b",
                        help="`1b` (issue 31's random-weight Llama, benchmarks/model_1b.py) or a "
                             "Hugging Face folder")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-memory", type=int, default=1 << 30)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single", type=int, default=5, help="requests of the single stream")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--start-timeout", type=float, default=900)
    parser.add_argument("--served-threads", type=int, default=0,
                        help="OMP_NUM_THREADS for the stack only (default: unset, every core "
                             "and the contention guard, as offline)")
    args = parser.parse_args(argv)
    from shoal import LLM
    from shoal.shared.embedded.net import free_port

    if args.model_path == "1b":
        from benchmarks.model_1b import make_1b

        folder = str(make_1b())
    else:
        folder = args.model_path
    root = Path(tempfile.mkdtemp(prefix="served-offline-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    load = [os.getloadavg()]
    proc = start_stack(folder, root, port, args)
    runs: dict[str, dict[str, list[dict[str, float]]]] = {"single": {}, "batch": {}}
    try:
        started = time.perf_counter()
        if why := asyncio.run(wait_served(url, proc, args.start_timeout)):
            raise SystemExit(f"{why}: {(root / 'serve.log').read_text()[-3000:]}")
        print(f"served after {time.perf_counter() - started:.0f} s (log {root / 'serve.log'})",
              flush=True)
        llm = LLM(folder, dtype=args.dtype, kv_cache_memory=args.kv_cache_memory, seed=0,
                  device="cpu")
        metrics_url = asyncio.run(engine_metrics_url(url))
        warm = samples(2, 4, 99)
        asyncio.run(run_served(url, NAME, warm, float("inf"), "fixed", 2, 0))
        offline_run(llm, warm, 2)
        for rnd in range(args.rounds):
            work = {"single": (samples(args.single, args.output_len, rnd), 1),
                    "batch": (samples(args.concurrency, args.output_len, 100 + rnd),
                              args.concurrency)}
            sides = ["served", "offline"] if rnd % 2 == 0 else ["offline", "served"]
            for name, (batch, conc) in work.items():
                for side in sides:
                    if side == "served" and conc == 1:
                        results, seconds = asyncio.run(run_single_served(url, metrics_url, batch,
                                                                           proc.pid))
                    elif side == "served":
                        results, seconds = asyncio.run(run_served(
                            url, NAME, batch, float("inf"), "fixed", conc, 0))
                    else:
                        results, seconds = offline_run(llm, batch, conc)
                    metrics = summarize(results, seconds)
                    if metrics["failed"]:
                        raise SystemExit(f"{side} {name}: {metrics['failed']} requests failed: "
                                         f"{sorted({r.error for r in results if not r.ok})[:3]}")
                    runs[name].setdefault(side, []).append(metrics)
                    extra = (f", less the engine's queue + prefill "
                             f"{metrics['median_overhead_ms']:.2f} ms (engine "
                             f"{metrics['median_engine_ttft_ms']:.1f}, of which queue "
                             f"{metrics['median_engine_queue_ms']:.2f})"
                             if "median_overhead_ms" in metrics else "")
                    print(f"round {rnd + 1} {name:6s} {side:7s} "
                          f"{metrics['output_throughput']:7.1f} tok/s, median TTFT "
                          f"{metrics['median_ttft_ms']:.1f} ms{extra}", flush=True)
            load.append(os.getloadavg())
        llm.shutdown()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(90)
        except subprocess.TimeoutExpired:
            proc.kill()
        RESULTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / "serve.log", RESULTS / "served_offline-serve.log")
        if (root / "stack" / "logs").is_dir():  # the engine's (threads, contention guard)
            shutil.copytree(root / "stack" / "logs", RESULTS / "served_offline-logs",
                            dirs_exist_ok=True)
        shutil.rmtree(root, ignore_errors=True)  # the stack's database and stream
    summary = report(runs)
    out = RESULTS / f"served_offline-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": folder, "args": vars(args), "load": load, "runs": runs,
                               "summary": summary}, indent=2))
    print("load average (1 min) over the run: " + ", ".join(f"{x[0]:.1f}" for x in load))
    print(f"wrote {out}")
    return 0


def report(runs: dict[str, dict[str, list[dict[str, float]]]]) -> dict[str, float]:
    def median(name: str, side: str, key: str) -> float:
        return statistics.median(m[key] for m in runs[name][side])

    out: dict[str, float] = {}
    for name in runs:
        served = median(name, "served", "output_throughput")
        offline = median(name, "offline", "output_throughput")
        out[f"{name}_served_tok_s"], out[f"{name}_offline_tok_s"] = served, offline
        out[f"{name}_ratio"] = served / offline
        print(f"{name:6s} served {served:7.1f} tok/s, offline {offline:7.1f}: "
              f"{served / offline:.3f}x (target >= 0.95)")
    out["ttft_overhead_ms"] = (median("single", "served", "median_ttft_ms")
                               - median("single", "offline", "median_ttft_ms"))
    print(f"TTFT added by the cluster path at concurrency 1: {out['ttft_overhead_ms']:.1f} ms "
          "(served median - offline median; the machine's pace moves it)")
    pooled = {side: statistics.median(v for m in runs["single"][side]
                                      for v in [m.get("median_overhead_ms")] if v is not None)
              for side in ("served", "offline")
              if all("median_overhead_ms" in m for m in runs["single"][side])}
    if len(pooled) == 2:
        out["served_overhead_ms"], out["offline_overhead_ms"] = pooled["served"], pooled["offline"]
        out["cluster_path_ms"] = pooled["served"] - pooled["offline"]
        print(f"per request, TTFT less the engine's queue + prefill (median of the rounds' "
              f"medians): served {pooled['served']:.2f} ms, offline {pooled['offline']:.2f}: "
              f"the cluster path adds {out['cluster_path_ms']:.2f} ms (target < 5 ms)")
    return out


if __name__ == "__main__":
    sys.exit(main())
