"""The CPU thread count an engine picks, and how it says so."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.cpu_threads import (
    ContentionGuard, busy_cpu_seconds, cpu_list, cpu_threads, default_cpu_threads,
    other_cpu_seconds,
)


def test_every_usable_core_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert default_cpu_threads() == cores
    assert cpu_threads(None) == (cores, "default: every usable core")


def test_num_threads_then_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    """OMP_NUM_THREADS is read where the EngineConfig is built (the entry point), not by the
    runner: the runner's count is the config's, or every usable core."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert EngineConfig(model="m", num_threads=5).num_threads == 5
    assert EngineConfig(model="m").num_threads == 3
    assert cpu_threads(5) == (5, "num_threads")
    assert cpu_threads(None) == (default_cpu_threads(), "default: every usable core")
    for junk in ("0", "", "two", "2,1"):  # not a positive count: the default
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert EngineConfig(model="m").num_threads is None


def test_cpu_list_prints_ranges() -> None:
    assert cpu_list({0, 1, 2, 5}) == "0-2,5"
    assert cpu_list({7}) == "7"
    assert cpu_list({0, 2, 3, 4, 8, 9}) == "0,2-4,8-9"


class Machine:
    """A fake clock and the CPU seconds other processes have used, advanced step by step."""

    def __init__(self) -> None:
        self.now = 0.0
        self.others = 0.0

    def run(self, seconds: float, other_cores: float) -> None:
        """`seconds` pass while other processes keep `other_cores` cores busy."""
        self.now += seconds
        self.others += seconds * other_cores


def guard(machine: Machine, max_threads: int = 2, cores: int = 2, window: int = 4,
          window_s: float = 1.0) -> tuple[ContentionGuard, list[int]]:
    """A guard on `machine` that records the counts it sets instead of changing torch's."""
    set_to: list[int] = []
    return ContentionGuard(max_threads, cores, window, window_s, sample=lambda: machine.others,
                           set_threads=set_to.append, clock=lambda: machine.now), set_to


def steps(g: ContentionGuard, machine: Machine, n: int, seconds: float,
          other_cores: float) -> list[int | None]:
    out = []
    for _ in range(n):
        out.append(g.before_step())
        machine.run(seconds, other_cores)
        g.after_step()
    return out


def test_guard_keeps_every_core_on_a_quiet_machine() -> None:
    m = Machine()
    g, set_to = guard(m)
    assert steps(g, m, 16, 0.05, 0.2).count(None) == 16
    assert g.threads == 2 and set_to == []


def test_guard_keeps_both_threads_beside_a_served_engines_own_services() -> None:
    """A gateway, NATS and a client beside a served engine keep about half a core busy: two
    threads still decode faster there (docs/figures.md), so the guard keeps them."""
    m = Machine()
    g, set_to = guard(m)
    steps(g, m, 40, 0.1, 0.5)
    assert set_to == [] and g.threads == 2


def test_guard_gives_a_core_up_under_load_and_takes_it_back() -> None:
    m = Machine()
    g, set_to = guard(m)
    busy = steps(g, m, 5, 0.1, 1.0)  # one core taken, all the time
    assert busy[-1] == 1 and set_to == [1]
    quiet = steps(g, m, 4, 0.1, 0.1)
    assert quiet[-1] == 2 and set_to == [1, 2] and g.threads == 2


def test_guard_leaves_what_the_others_do_not_use() -> None:
    m = Machine()
    g, _ = guard(m, max_threads=8, cores=8)
    assert steps(g, m, 5, 0.1, 3.0)[-1] == 5  # 3 cores taken: 5 left
    m = Machine()
    g, _ = guard(m, max_threads=8, cores=8)
    assert steps(g, m, 5, 0.1, 40.0)[-1] == 1  # never fewer than one


def test_guard_decides_after_slow_steps() -> None:
    """A step on a contended core can take seconds: a window also ends after window_s."""
    m = Machine()
    g, set_to = guard(m, window=16)
    assert steps(g, m, 2, 3.0, 1.5) == [None, 1]  # the second step ends the window (3 s > 1 s)
    assert steps(g, m, 3, 0.01, 0.0) == [None, None, None]  # fast quiet steps: the count decides


def test_guard_ignores_what_others_did_while_the_engine_was_idle() -> None:
    """A served engine idle while another process held both cores (a batch job, an offline
    benchmark) keeps its threads when its next burst finds the machine quiet; contention that
    goes on when the steps resume still counts."""
    m = Machine()
    g, set_to = guard(m)
    steps(g, m, 8, 0.05, 0.2)
    m.run(30.0, 2.0)  # idle: no step for 30 s while the others keep both cores busy
    assert steps(g, m, 12, 0.05, 0.2).count(None) == 12 and set_to == []
    m.run(30.0, 2.0)
    assert steps(g, m, 5, 0.1, 1.0)[-1] == 1 and set_to == [1]  # the others stayed: counted

    """Busy time this process spends (a spinning loop) shows in the machine's busy time but not
    in the others' CPU seconds."""
    busy0, own0 = busy_cpu_seconds()
    others0 = other_cpu_seconds()
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    busy1, own1 = busy_cpu_seconds()
    others1 = other_cpu_seconds()
    assert own1 - own0 >= 0.25  # the spin is counted as ours, in seconds
    assert others1 - others0 <= (busy1 - busy0) - 0.2  # and left out of the others' time


def test_an_engine_with_the_default_count_says_so_and_guards_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without num_threads / OMP_NUM_THREADS a CPU engine takes every usable core, says where the
    count came from, and steps under the guard; an explicit count has no guard."""
    import torch

    from shoal.services.engine import LLM, SamplingParams
    from tests.tiny_models import save_tiny_model

    folder = str(save_tiny_model("llama", tmp_path / "llama"))
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        llm = LLM(folder, device="cpu", num_kv_blocks=64)
        runner = llm.engine.runner
        assert f"CPU: {default_cpu_threads()} torch intra-op threads (default: every usable core" \
            in runner.settings and "affinity " in runner.settings
        assert (runner.contention is not None) == (default_cpu_threads() > 1)
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        explicit = LLM(folder, device="cpu", num_kv_blocks=64, num_threads=1).engine.runner
        assert "CPU: 1 torch intra-op threads (num_threads)" in explicit.settings
        assert explicit.contention is None
    finally:
        torch.set_num_threads(before)
