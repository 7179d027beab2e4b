"""Soak: a running stack held at saturation for a long time (default one hour), watching for
leaks and drift. Not part of `make test`.

    make up   # in another terminal (or `shoal up --data-dir DIR`)
    .venv/bin/python -m loadtests.soak --base-url http://127.0.0.1:8000 \
        --model SmolLM2-135M-Instruct --duration 3600 --concurrency 32 [--data-dir ~/.shoal]

`--concurrency` streaming chats run back to back (saturation: every engine slot busy and the
gateway's queue non-empty). Every `--window` seconds it prints the window's requests, errors by
status, p50/p99 end-to-end latency, and the resident memory (RSS) of every process of the stack
(`shoal up` and everything it started: servers, services, engines, found through the data dir's
stack.json), the CPU seconds each process used in the window, and the machine's own speed
then (a fixed matmul probe: on a shared machine throughput follows it). At the end: memory of
each process at start and end, errors, and the p99 drift (last window's p99 over the first's),
as a table and as JSON under loadtests/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Window:
    started: float
    latencies: list[float] = field(default_factory=list)
    errors: Counter[str] = field(default_factory=Counter)
    chunks: int = 0
    """Streamed content chunks (about one per token): fewer requests with steady chunks per
    request is the stack slowing, not shorter answers."""

    def quantile(self, q: float) -> float:
        if len(self.latencies) < 2:
            return self.latencies[0] if self.latencies else float("nan")
        return statistics.quantiles(self.latencies, n=100, method="inclusive")[int(q * 100) - 1]


def stack_processes(data_dir: Path) -> dict[str, psutil.Process]:
    """`shoal up` (its pid in stack.json) and every process it started, by a readable name;
    engines also from the worker's records (<data_dir>/engines): an engine adopted by a
    restarted agent is no longer under `shoal up`."""
    stack = json.loads((data_dir / "stack.json").read_text())
    root = psutil.Process(int(stack["pid"]))
    found = {"shoal up": root}
    candidates = list(root.children(recursive=True))
    for record in sorted((data_dir / "engines").glob("*.json")):
        try:
            candidates.append(psutil.Process(int(json.loads(record.read_text())["pid"])))
        except (OSError, ValueError, KeyError, psutil.Error):
            continue
    for proc in candidates:
        try:
            argv = proc.cmdline()
            parent = proc.parent()
        except psutil.Error:
            continue
        exe = Path(argv[0]).name if argv else proc.name()
        if exe in ("nats-server", "postgres") and parent and parent.pid == root.pid:
            name = exe
        elif "-m" in argv and "shoal" in argv:
            rest = argv[argv.index("shoal") + 1:]
            name = " ".join(rest[:1] + ([rest[-1][:8]] if rest[:1] == ["engine"] else []))
        else:
            continue
        found[name] = proc
    return found


def with_backends(name: str, proc: psutil.Process) -> list[psutil.Process]:
    """A process and, for Postgres, its backends: what each figure of that name sums over."""
    return [proc, *proc.children()] if name == "postgres" else [proc]


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """CPU time (user + system) each process has used so far; per-window differences show which
    process takes more of the cores as the hour goes on."""
    out = {}
    for name, proc in procs.items():
        try:
            times = [p.cpu_times() for p in with_backends(name, proc)]
        except psutil.Error:
            continue
        out[name] = sum(t.user + t.system for t in times)
    return out


def rss_mib(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """Resident memory of each process, in MiB."""
    out = {}
    for name, proc in procs.items():
        try:
            rss = sum(p.memory_info().rss for p in with_backends(name, proc))
        except psutil.Error:
            continue
        out[name] = rss / 2**20
    return out


PROBE = Path(__file__).with_name("machine_probe.py")


async def machine_speed() -> float:
    """loadtests/machine_probe.py in a child process, so the streams keep flowing (it competes
    with the stack for its 2 s: about 1 % of a 5-minute window)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, str(PROBE),
                                                stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    return float(out.decode().strip() or "nan")


async def one_stream(client: openai.AsyncOpenAI, model: str, max_tokens: int,
                     windows: list[Window]) -> None:
    started = time.monotonic()
    try:
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0.7,
            messages=[{"role": "user", "content": "Tell me a short story about a river."}])
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                windows[-1].chunks += 1
        windows[-1].latencies.append(time.monotonic() - started)
    except openai.APIStatusError as exc:
        windows[-1].errors[str(exc.status_code)] += 1
        await asyncio.sleep(0.5)
    except openai.APIError as exc:
        windows[-1].errors[type(exc).__name__] += 1
        await asyncio.sleep(0.5)


async def soak(args: argparse.Namespace) -> dict[str, object]:
    procs = stack_processes(args.data_dir)
    memory_start = rss_mib(procs)
    cpu_before = cpu_seconds(procs)
    pids_start = {name: proc.pid for name, proc in procs.items()}
    client = openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", api_key=args.api_key,
                                max_retries=0, timeout=120)
    windows = [Window(time.monotonic())]
    deadline = time.monotonic() + args.duration
    stop = asyncio.Event()

    async def worker() -> None:
        while not stop.is_set():
            await one_stream(client, args.model, args.max_tokens, windows)

    tasks = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
    report = []
    print(f"{'t (s)':>7} {'requests':>8} {'errors':>7} {'p50 s':>7} {'p99 s':>7}  RSS MiB  "
          "CPU s in the window")
    while time.monotonic() < deadline:
        await asyncio.sleep(min(args.window, max(0.0, deadline - time.monotonic())))
        done = windows[-1]
        windows.append(Window(time.monotonic()))
        speed = await machine_speed()
        procs = stack_processes(args.data_dir)  # a restarted process is found again
        memory = rss_mib(procs)
        cpu_now = cpu_seconds(procs)
        cpu = {k: v - cpu_before[k] for k, v in cpu_now.items() if k in cpu_before}
        cpu_before = cpu_now
        row = {"t": round(time.monotonic() - windows[0].started), "requests": len(done.latencies),
               "chunks": done.chunks, "errors": dict(done.errors), "p50_s": done.quantile(0.5),
               "p99_s": done.quantile(0.99), "rss_mib": memory, "cpu_s": cpu,
               "machine_speed": speed, "requests_per_speed": len(done.latencies) / speed}
        report.append(row)
        print(f"{row['t']:>7} {row['requests']:>8} {sum(done.errors.values()):>7} "
              f"{row['p50_s']:>7.2f} {row['p99_s']:>7.2f}  "
              + " ".join(f"{k}={v:.0f}" for k, v in memory.items())
              + "  CPU s: " + " ".join(f"{k}={v:.0f}" for k, v in cpu.items())
              + f"  chunks={done.chunks} machine={speed:.1f} requests/machine="
              f"{row['requests_per_speed']:.1f}", flush=True)
    stop.set()
    await asyncio.gather(*tasks, return_exceptions=True)
    await client.close()
    procs = stack_processes(args.data_dir)
    memory_end = rss_mib(procs)
    restarted = sorted(name for name, pid in pids_start.items()
                       if name in procs and procs[name].pid != pid)
    gone = sorted(set(pids_start) - set(procs))
    first, last = report[0], report[-1]
    errors: Counter[str] = Counter()
    for row in report:
        errors.update(row["errors"])  # type: ignore[arg-type]
    return {"duration_s": args.duration, "concurrency": args.concurrency, "model": args.model,
            "requests": sum(int(r["requests"]) for r in report), "errors": dict(errors),
            "p99_first_window_s": first["p99_s"], "p99_last_window_s": last["p99_s"],
            "p99_drift": last["p99_s"] / first["p99_s"] if first["p99_s"] else None,
            "memory_start_mib": memory_start, "memory_end_mib": memory_end,
            "restarted": restarted, "gone": gone, "windows": report}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--api-key", default="unused")
    parser.add_argument("--data-dir", type=Path, default=Path.home() / ".shoal")
    parser.add_argument("--duration", type=float, default=3600.0, help="seconds (default 1 h)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--window", type=float, default=60.0, help="seconds per report line")
    parser.add_argument("--out", type=Path, default=RESULTS / "soak.json")
    args = parser.parse_args()
    result = asyncio.run(soak(args))
    print("\nprocess            RSS start MiB   RSS end MiB")
    start, end = result["memory_start_mib"], result["memory_end_mib"]
    for name in sorted(set(start) | set(end)):  # type: ignore[arg-type]
        note = (" (restarted)" if name in result["restarted"]  # type: ignore[operator]
                else " (gone)" if name in result["gone"] else "")  # type: ignore[operator]
        print(f"{name:<18} {start.get(name, float('nan')):>13.0f} "  # type: ignore[union-attr]
              f"{end.get(name, float('nan')):>13.0f}{note}")  # type: ignore[union-attr]
    drift = result["p99_drift"]
    print(f"requests {result['requests']}, errors {result['errors'] or 'none'}, p99 "
          f"{result['p99_first_window_s']:.2f}s -> {result['p99_last_window_s']:.2f}s "
          + (f"(drift {drift:.2f}x)" if drift else "(no drift: too few requests)"))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
