"""How many CPU threads an engine's torch ops use, and where that number came from (the log)."""

from __future__ import annotations

import os


def default_cpu_threads() -> int:
    """Every usable core (vLLM-CPU's rule: its OpenMP threads take all the cores it may use).
    On a quiet 2-core machine two threads decode about 1.7x faster than one (docs/figures.md,
    issue 13). On a machine shared with other busy processes, OpenMP's barriers wait on
    descheduled threads and steps slow down many times over: there, set `num_threads` (or
    OMP_NUM_THREADS) to the cores the engine really has."""
    return max(1, len(os.sched_getaffinity(0)))


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """(torch intra-op threads, where the number came from): `num_threads`, else
    OMP_NUM_THREADS when set to a positive integer, else every usable core."""
    if requested:
        return requested, "num_threads"
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    return default_cpu_threads(), "default: every usable core"


def cpu_list(cores: set[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (as taskset and /proc print them)."""
    runs: list[list[int]] = []
    for core in sorted(cores):
        if runs and core == runs[-1][-1] + 1:
            runs[-1].append(core)
        else:
            runs.append([core])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
