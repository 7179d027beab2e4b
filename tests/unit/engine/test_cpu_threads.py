"""The CPU thread count an engine picks, and how it says so."""

from __future__ import annotations

import os

import pytest

from shoal.services.engine.cpu_threads import cpu_list, cpu_threads, default_cpu_threads


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
