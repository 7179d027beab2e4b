"""The CPU thread count an engine picks, and how it says so."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shoal.services.engine.cpu_threads import (
    ContentionGuard, cpu_list, cpu_threads, default_cpu_threads, other_runnable_threads,
    own_runnable_threads,
)


def test_every_usable_core_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    assert default_cpu_threads() == cores
    assert cpu_threads(None) == (cores, "default: every usable core")


def test_num_threads_then_omp_num_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(5) == (5, "num_threads")
    assert cpu_threads(None) == (3, "OMP_NUM_THREADS")
    for junk in ("0", "", "two", "2,1"):  # not a positive count: the default
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert cpu_threads(None) == (default_cpu_threads(), "default: every usable core")


def test_cpu_list_prints_ranges() -> None:
    assert cpu_list({0, 1, 2, 5}) == "0-2,5"
    assert cpu_list({7}) == "7"
    assert cpu_list({0, 2, 3, 4, 8, 9}) == "0,2-4,8-9"


def guard(samples: list[int], max_threads: int = 2, cores: int = 2,
          window: int = 4) -> tuple[ContentionGuard, list[int]]:
    """A guard fed `samples` (runnable threads of other processes) that records the counts it
    sets instead of changing torch's."""
    feed, set_to = iter(samples), []
    return ContentionGuard(max_threads, cores, window, sample=lambda: next(feed),
                           set_threads=set_to.append, clock=lambda: 0.0), set_to


def test_guard_keeps_every_core_on_a_quiet_machine() -> None:
    g, set_to = guard([0, 0, 1, 0] * 4)  # now and then one other runnable thread: mean 0.25
    assert [g.before_step() for _ in range(16)].count(None) == 16
    assert g.threads == 2 and set_to == []


def test_guard_gives_a_core_up_under_load_and_takes_it_back() -> None:
    busy, quiet = [1, 1, 1, 1], [0, 0, 0, 1]  # busy: one core taken, all the time
    g, set_to = guard(busy + busy + quiet + quiet)
    changes = [g.before_step() for _ in range(16)]
    assert changes[3] == 1 and changes[11] == 2, changes  # ends of the first and third windows
    assert set_to == [1, 2] and g.threads == 2


def test_guard_leaves_what_the_others_do_not_use() -> None:
    g, set_to = guard([3, 3, 3, 3], max_threads=8, cores=8)  # 3 other threads: 5 cores left
    assert [g.before_step() for _ in range(4)][-1] == 5
    g, set_to = guard([40] * 4, max_threads=8, cores=8)
    assert g.before_step() == 1  # never fewer than one


def test_guard_decides_after_two_slow_steps() -> None:
    """A step on a contended core can take seconds: a window also ends after window_s."""
    feed, set_to, now = iter([1, 1, 0, 0, 0, 5]), [], [0.0]
    g = ContentionGuard(2, 2, window=16, window_s=1.0, sample=lambda: next(feed),
                        set_threads=set_to.append, clock=lambda: now[0])
    assert g.before_step() is None  # one sample is not enough, whatever the time
    now[0] = 9.0
    assert g.before_step() == 1
    for t in (9.1, 9.2, 9.3):  # quiet again, but fast steps: the step count decides
        now[0] = t
        assert g.before_step() is None


def test_own_threads_are_counted_as_own() -> None:
    """The calling thread is running, so it is one of this process's threads in state R; the
    others' count leaves it out. (Python threads spinning would not do as a check: those
    waiting for the GIL sleep, in state S.)"""
    assert own_runnable_threads() >= 1
    assert other_runnable_threads() >= 0


def test_guard_gives_up_at_once_when_others_fill_every_core() -> None:
    g, set_to = guard([12, 0, 0, 0, 0], window=4)
    assert g.before_step() == 1 and set_to == [1]  # the first sample: a collapsed step is slow
    assert [g.before_step() for _ in range(4)] == [None, None, None, 2]


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
