"""Scheduler placement benchmark: time per placement on synthetic fleets of W workers x 8 GPUs.

Places 5,000 instances (a mix of models: quarter-GPU, half-GPU, whole-GPU and 2-GPU TP instances,
some with label selectors or spread) into fleets of 100, 250, 500 and 1,000 workers, timing each
decision plus its accounting. Run: .venv/bin/python -m loadtests.scheduler_placement [--quick]

Per successful placement the cost is O(k + G log G + log W): k <= W workers checked in scorer
order (one comparison each) before the first fit, G GPUs of that worker, the order update. Filters
run once per request signature and fleet snapshot (O(W)). A request that does not fit is explained
once in O(W * G log G) and then answered from the planner's miss cache until a claim is released.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from datetime import datetime, UTC
from pathlib import Path

from shoal.services.scheduler.claim import ModelProfile, ModelShape
from shoal.services.scheduler.planner import Planner, build_request
from shoal.shared.schemas.registry import DeviceStatus, GpuDevice, ModelSpec, WorkerPublic
from shoal.shared.states import WorkerState

GIB = 1024**3
NOW = datetime(2026, 1, 1, tzinfo=UTC)
RESULTS = Path(__file__).resolve().parent / "results"


def make_fleet(num_workers: int, gpus_per_worker: int = 8) -> list[WorkerPublic]:
    fleet = []
    for i in range(num_workers):
        gpus = [GpuDevice(index=g, name="NVIDIA H100 80GB", memory_total=80 * GIB)
                for g in range(gpus_per_worker)]
        state = WorkerState.NOT_READY if i % 97 == 96 else WorkerState.READY
        fleet.append(WorkerPublic(
            id=f"wid-{i:05d}", name=f"worker-{i:05d}", hostname=f"host-{i:05d}",
            labels={"zone": "a" if i % 2 else "b"}, simulated=True, state=state,
            status=DeviceStatus(cpu_cores=64, memory_total=1024 * GIB, gpus=gpus),
            last_heartbeat_at=NOW, created_at=NOW, updated_at=NOW, version=1))
    return fleet


def _profile(params_b: float, heads: int, kv_heads: int, hidden: int, layers: int) -> ModelProfile:
    shape = ModelShape("LlamaForCausalLM", layers, hidden, heads, kv_heads, hidden // heads,
                       hidden * 3, 32000, 4096)
    return ModelProfile("/models/bench", "config", shape, int(params_b * 1e9), 0, "bfloat16")


def model_mix() -> list[tuple[float, ModelSpec, ModelProfile]]:
    """(weight, spec, profile): what each of the 5,000 requests deploys."""
    p7, p13 = _profile(7, 32, 8, 4096, 32), _profile(13, 40, 40, 5120, 40)
    p70 = _profile(70, 64, 8, 8192, 80)
    return [
        (0.45, ModelSpec(source="/m/7b", gpu_memory_utilization=0.2), p7),
        (0.20, ModelSpec(source="/m/13b", gpu_memory_utilization=0.45), p13),
        (0.10, ModelSpec(source="/m/7b", gpu_memory_utilization=0.2,
                         worker_selector={"zone": "a"}), p7),
        (0.10, ModelSpec(source="/m/7b", gpu_memory_utilization=0.2,
                         placement_strategy="spread"), p7),
        (0.10, ModelSpec(source="/m/7b"), p7),
        (0.05, ModelSpec(source="/m/70b"), p70),
    ]


def run(num_workers: int, num_instances: int, seed: int = 0) -> dict[str, float | int]:
    fleet = make_fleet(num_workers)
    mix = model_mix()
    requests = [build_request(s, p) for _, s, p in mix]
    rng = random.Random(seed)
    picks = rng.choices(range(len(mix)), weights=[w for w, _, _ in mix], k=num_instances)
    t0 = time.perf_counter()
    planner = Planner(fleet)
    build_ms = (time.perf_counter() - t0) * 1e3
    ok_ns: list[int] = []
    fail_ns: list[int] = []
    explained_ns: list[int] = []  # failures decided from scratch (not the planner's miss cache)
    seen: set[int] = set()
    for n, k in enumerate(picks, 1):
        start = time.perf_counter_ns()
        result = planner.place_request(requests[k])
        planner.commit(result)
        elapsed = time.perf_counter_ns() - start
        (ok_ns if result.ok else fail_ns).append(elapsed)
        if not result.ok and id(result) not in seen:
            seen.add(id(result))
            explained_ns.append(elapsed)
        if n % 1000 == 0:
            print(f"  {num_workers} workers: {n}/{num_instances} placed "
                  f"({len(ok_ns)} scheduled, {len(fail_ns)} pending)", flush=True)
    every = sorted(ok_ns + fail_ns)

    def ms(values: list[int], q: float) -> float:
        if not values:
            return 0.0
        values = sorted(values)
        return values[min(len(values) - 1, int(q * len(values)))] / 1e6

    return {
        "workers": num_workers, "gpus": num_workers * 8, "instances": num_instances,
        "scheduled": len(ok_ns), "pending": len(fail_ns), "index_build_ms": round(build_ms, 2),
        "median_ms": round(statistics.median(every) / 1e6, 4), "p99_ms": round(ms(every, 0.99), 4),
        "median_scheduled_ms": round(ms(ok_ns, 0.5), 4),
        "p99_scheduled_ms": round(ms(ok_ns, 0.99), 4),
        "median_pending_ms": round(ms(fail_ns, 0.5), 4),
        "p99_pending_ms": round(ms(fail_ns, 0.99), 4),
        "explained_pending": len(explained_ns),
        "median_explained_ms": round(ms(explained_ns, 0.5), 4),
        "total_s": round(sum(every) / 1e9, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, nargs="*", default=[100, 250, 500, 1000])
    parser.add_argument("--instances", type=int, default=5000)
    parser.add_argument("--quick", action="store_true", help="1,000 instances (a smoke run)")
    args = parser.parse_args()
    instances = 1000 if args.quick else args.instances
    rows = []
    for w in args.workers:
        print(f"fleet of {w} workers x 8 GPUs: placing {instances} instances", flush=True)
        rows.append(run(w, instances))
    head = ("workers", "GPUs", "sched", "pending", "median ms", "p99 ms", "med sched",
            "p99 sched", "med pending", "explained", "med explain", "build ms")
    keys = ("workers", "gpus", "scheduled", "pending", "median_ms", "p99_ms",
            "median_scheduled_ms", "p99_scheduled_ms", "median_pending_ms", "explained_pending",
            "median_explained_ms", "index_build_ms")
    print("\n" + " | ".join(f"{h:>11}" for h in head))
    for row in rows:
        print(" | ".join(f"{row[k]:>11}" for k in keys))
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"scheduler_placement-{datetime.now(UTC):%Y%m%dT%H%M%SZ}.json"
    out.write_text(json.dumps({"python": platform.python_version(), "machine": platform.machine(),
                               "instances": instances, "rows": rows}, indent=2))
    print(f"\nwrote {out}")


if __name__ == "__main__":
    main()
