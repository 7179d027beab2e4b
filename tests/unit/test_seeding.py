"""tests/seeding.py: a test's random draws follow the run's seed (SHOAL_TEST_SEED), and a failing
test's report names that seed, so the failure can be replayed."""

from __future__ import annotations

import random

import pytest
import torch

from tests import seeding

pytest_plugins = ["pytester"]


def test_the_same_seed_draws_the_same_data() -> None:
    draws = []
    for _ in range(2):
        seeding.seed_everything(1234)
        gen = seeding.fresh_generator()
        draws.append((random.random(), torch.randn(3, generator=gen).tolist(),
                      torch.randn(2, generator=seeding.fresh_generator()).tolist()))
    assert draws[0] == draws[1]
    seeding.seed_everything(1235)
    assert torch.randn(3, generator=seeding.fresh_generator()).tolist() != draws[0][1]


@pytest.mark.parametrize("raw, seed", [("", seeding.DEFAULT_SEED), ("42", 42), (" 7 ", 7)])
def test_the_seed_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch, raw: str,
                                             seed: int) -> None:
    monkeypatch.setenv(seeding.ENV, raw)
    seeding.run_seed.cache_clear()
    try:
        assert seeding.run_seed() == seed
    finally:
        seeding.run_seed.cache_clear()


def test_random_draws_one_seed_per_run(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(seeding.ENV, "random")
    seeding.run_seed.cache_clear()
    try:
        assert seeding.run_seed() == seeding.run_seed()  # drawn once, kept for the run
    finally:
        seeding.run_seed.cache_clear()


def test_a_failure_names_its_seed(pytester: pytest.Pytester,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(seeding.ENV, "99")
    seeding.run_seed.cache_clear()
    pytester.makeini("[pytest]\nasyncio_default_fixture_loop_scope = function\n")
    pytester.makeconftest("from tests.conftest import (pytest_report_header,\n"
                          "    pytest_runtest_makereport, pytest_runtest_setup)\n")
    pytester.makepyfile("import random\n"
                        "def test_draw():\n"
                        "    assert random.random() < 0\n")
    try:
        result = pytester.runpytest_inprocess()
    finally:
        seeding.run_seed.cache_clear()
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["shoal test seed: 99 *", "*SHOAL_TEST_SEED=99 replays*"])
