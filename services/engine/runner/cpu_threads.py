"""How many CPU threads an engine's torch ops use, and where that number came from (the log)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger(__name__)


def default_cpu_threads() -> int:
    """Every usable core (vLLM-CPU's rule: its OpenMP threads take all the cores it may use).
    On a quiet 2-core machine two threads decode about 1.7x faster than one (docs/figures.md,
    issue 13). On a machine shared with other busy processes, OpenMP's barriers wait on
    descheduled threads and steps slow down many times over: there, set `num_threads` (or
    OMP_NUM_THREADS, which EngineConfig reads) to the cores the engine really has."""
    return max(1, len(os.sched_getaffinity(0)))


def cpu_threads(requested: int | None) -> tuple[int, str]:
    """(torch intra-op threads, where the number came from): EngineConfig.num_threads (given, or
    OMP_NUM_THREADS, which EngineConfig reads when it is built), else every usable core."""
    if requested:
        return requested, "num_threads"
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


def busy_cpu_seconds() -> tuple[float, float]:
    """(CPU seconds every core has spent busy since boot, of which this process's own): from
    /proc/stat's first line and /proc/self/stat's utime + stime; (0, 0) where /proc is missing."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        with open("/proc/self/stat", "rb") as f:
            stat = f.read()
        rest = stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return 0.0, 0.0
    tick = os.sysconf("SC_CLK_TCK")
    busy = v[0] + v[1] + v[2] + v[5] + v[6] + v[7]  # user nice system irq softirq steal
    return busy / tick, (int(rest[11]) + int(rest[12])) / tick


def other_cpu_seconds() -> float:
    """CPU seconds other processes have used since boot (the machine's busy time less this
    process's, so the engine's own OpenMP threads and event loop never count as contention)."""
    busy, own = busy_cpu_seconds()
    return busy - own


SLACK = 0.25
"""A thread is given up only for about a whole core (0.75 of one) that others keep busy: a
co-located gateway, NATS and client use less, and two threads still win beside them (served
c=32, 2 cores: 171 tok/s on 2 threads, 107 on 1; docs/figures.md)."""


class ContentionGuard:
    """Gives up intra-op threads while other processes keep the engine's cores busy, and takes
    them back when they stop; only for the default thread count (an explicit `num_threads` or
    OMP_NUM_THREADS is obeyed as given).

    Why: OpenMP's barriers wait for every thread of a parallel region, so one thread descheduled
    by another process stalls each of the ~120 matmuls of a step; on the 2-core build machine
    under load two threads decoded over 10x slower than one (docs/figures.md, issue 13), while on
    a quiet machine they are about 1.7x faster. The measure is the CPU time other processes used
    over a window (`window` steps, or `window_s` seconds, whichever ends first): the cores they
    kept busy on average, whatever moment a step starts at. (A count of runnable threads at step
    starts saw a served engine's own gateway and client, woken by the step before, and halved
    its threads for them.) The engine keeps the cores the others leave (at least one, at most
    the default). Only time spent stepping counts: after an idle gap (more than `window_s`
    between one step's end and the next step's start) a fresh window starts, since what others
    did while the engine waited for work never slowed a step and may be over (a served engine
    idle through another process's run used to start its next burst on one thread)."""

    def __init__(self, max_threads: int, cores: int, window: int = 16, window_s: float = 1.0,
                 sample: Callable[[], float] = other_cpu_seconds,
                 set_threads: Callable[[int], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_threads = max_threads
        self.cores = cores
        self.window = window
        self.window_s = window_s
        self.sample = sample
        self.set_threads = set_threads or _set_torch_threads
        self.clock = clock
        self.threads = max_threads
        self._start: tuple[float, float] | None = None
        """(clock, others' CPU seconds) when the window began."""
        self._steps = 0
        self._last_end: float | None = None
        """When the last step ended (after_step)."""

    def before_step(self) -> int | None:
        """Count the step; at the end of a window return the new thread count if it changed."""
        now = self.clock()
        idle = self._last_end is not None and now - self._last_end > self.window_s
        self._last_end = None
        if self._start is None or idle:
            self._start, self._steps = (now, self.sample()), 0
            return None
        self._steps += 1
        elapsed = now - self._start[0]
        if elapsed <= 0 or (self._steps < self.window and elapsed < self.window_s):
            return None
        others = self.sample()
        busy = (others - self._start[1]) / elapsed  # cores the others kept busy, on average
        self._start, self._steps = (now, others), 0
        target = max(1, min(self.max_threads, self.cores - int(busy + SLACK)))
        if target == self.threads:
            return None
        log.info("CPU contention: other processes kept %.1f cores busy over %.1f s; torch "
                 "intra-op threads %d -> %d", busy, elapsed, self.threads, target)
        self.threads = target
        self.set_threads(target)
        return target

    def after_step(self) -> None:
        self._last_end = self.clock()


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
