"""Subjects are built, validated and stable; simulated device specs parse or are refused."""

from __future__ import annotations

import pytest

from shoal.services.worker.devices import GIB, parse_simulated
from shoal.shared.bus import subjects
from shoal.shared.errors import InvalidRequest


def test_subject_names_are_the_documented_ones() -> None:
    assert subjects.registry("models", "create") == "shoal.registry.models.create"
    assert subjects.event("instances", "abc123") == "shoal.events.instances.abc123"
    assert subjects.heartbeat("w1") == "shoal.workers.w1.heartbeat"
    assert subjects.infer("i1") == "shoal.infer.i1"
    assert subjects.abort("i1") == "shoal.abort.i1" and subjects.load("i1") == "shoal.load.i1"
    assert subjects.SCHEDULER_LEADER == "shoal.scheduler.leader.get"
    assert subjects.SCHEDULER_PLAN == "shoal.scheduler.placement.plan"


@pytest.mark.parametrize("bad", ["a.b", "a b", "", "x>"])
def test_ids_that_would_break_subjects_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        subjects.event("models", bad)
    with pytest.raises(ValueError):
        subjects.registry("nonsense", "create")


def test_simulated_devices() -> None:
    status = parse_simulated("8xH100-80GB")
    assert len(status.gpus) == 8 and {g.name for g in status.gpus} == {"H100"}
    assert [g.index for g in status.gpus] == list(range(8))
    assert all(g.memory_total == 80 * GIB and "simulated" in g.vendor for g in status.gpus)
    mixed = parse_simulated("2xA10-24GB,1xcpu")
    assert [(g.index, g.name, g.memory_total) for g in mixed.gpus] == [(0, "A10", 24 * GIB),
                                                                       (1, "A10", 24 * GIB)]
    assert parse_simulated("1xcpu").gpus == [] and parse_simulated("1xcpu").memory_total > 0
    assert parse_simulated("1xRTX-4090-24GB").gpus[0].name == "RTX-4090"


@pytest.mark.parametrize("bad", ["H100", "8xH100", "0xA10-24GB", "8xH100-80TB", "x"])
def test_bad_simulated_devices_are_refused(bad: str) -> None:
    with pytest.raises(InvalidRequest):
        parse_simulated(bad)
