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


def own_runnable_threads() -> int:
    """This process's threads in state R (running or waiting for a core), the caller included."""
    own = 0
    for task in os.scandir("/proc/self/task"):
        try:
            with open(os.path.join(task.path, "stat"), "rb") as f:
                stat = f.read()
        except OSError:  # the thread ended meanwhile
            continue
        own += stat[stat.rindex(b")") + 2:][:1] == b"R"
    return own


def other_runnable_threads() -> int:
    """Threads of other processes runnable right now: the machine's (/proc/loadavg's 4th field,
    "3/345") less this process's own, so the engine's event loop and OpenMP threads never count
    as contention; 0 where /proc is missing."""
    try:
        with open("/proc/loadavg") as f:
            machine = int(f.read().split()[3].split("/")[0])
        return max(0, machine - own_runnable_threads())
    except (OSError, IndexError, ValueError):
        return 0


class ContentionGuard:
    """Gives up intra-op threads while other processes keep the engine's cores busy, and takes
    them back when they stop; only for the default thread count (an explicit `num_threads` or
    OMP_NUM_THREADS is obeyed as given).

    Why: OpenMP's barriers wait for every thread of a parallel region, so one thread descheduled
    by another process stalls each of the ~120 matmuls of a step; on the 2-core build machine
    under load two threads decoded over 10x slower than one (docs/figures.md, issue 13), while on
    a quiet machine they are about 1.7x faster. Before every step the runner samples how many
    threads of other processes are runnable; over each `window` steps (or `window_s` seconds)
    that mean is what they occupy, and the engine keeps the
    cores it leaves (rounded; at least one, at most the default)."""

    def __init__(self, max_threads: int, cores: int, window: int = 16, window_s: float = 1.0,
                 sample: Callable[[], int] = other_runnable_threads,
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
        self._others: list[int] = []
        self._since = 0.0

    def before_step(self) -> int | None:
        """Sample once; at the end of a window (`window` steps, or two once `window_s` has
        passed: a contended step can take seconds; or at once when other processes' runnable
        threads alone fill every core) return the new thread count if it changed."""
        now = self.clock()
        if not self._others:
            self._since = now
        self._others.append(self.sample())
        if (len(self._others) < self.window and self._others[-1] < self.cores
                and (len(self._others) < 2 or now - self._since < self.window_s)):
            return None  # (a sample with every core taken by others ends the window at once)
        busy = sum(self._others) / len(self._others)
        self._others.clear()
        target = max(1, min(self.max_threads, self.cores - int(busy + 0.5)))
        if target == self.threads:
            return None
        log.info("CPU contention: %.1f runnable threads of other processes on average over %.1f "
                 "s; torch intra-op threads %d -> %d", busy, now - self._since, self.threads,
                 target)
        self.threads = target
        self.set_threads(target)
        return target


def _set_torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
