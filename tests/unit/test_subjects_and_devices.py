"""Subjects are built, validated, namespaced and stable; simulated device specs parse or are
refused."""

from __future__ import annotations

import pytest

from shoal.services.worker.devices import GIB, parse_simulated
from shoal.shared.bus.subjects import Subjects
from shoal.shared.config import Settings
from shoal.shared.errors import InvalidRequest

subjects = Subjects("ns1")


def test_subject_names_are_the_documented_ones() -> None:
    assert subjects.registry("models", "create") == "shoal.ns1.registry.models.create"
    assert subjects.event("instances", "abc123") == "shoal.ns1.events.instances.abc123"
    assert subjects.heartbeat("w1") == "shoal.ns1.workers.w1.heartbeat"
    assert subjects.infer("i1") == "shoal.ns1.infer.i1"
    assert subjects.abort("i1") == "shoal.ns1.abort.i1"
    assert subjects.load("i1") == "shoal.ns1.load.i1"
    assert subjects.scheduler_leader == "shoal.ns1.scheduler.leader.get"
    assert subjects.scheduler_plan == "shoal.ns1.scheduler.placement.plan"
    assert subjects.events_stream == "SHOAL_EVENTS_ns1"
    assert subjects.registry_service == "shoal-registry-ns1"


def test_two_namespaces_share_no_name() -> None:
    a, b = Subjects("a"), Subjects("b")
    names = ("registry_service", "scheduler_service", "events_stream", "events_all",
             "heartbeats_all", "load_all", "metrics_targets", "scheduler_leader")
    assert all(getattr(a, n) != getattr(b, n) for n in names)
    assert a.infer("i") != b.infer("i") and a.registry("models", "get") != b.registry("models",
                                                                                        "get")


def test_default_namespace_comes_from_the_data_dir(tmp_path) -> None:
    one, two = Settings(data_dir=tmp_path / "one"), Settings(data_dir=tmp_path / "two")
    assert one.ns != two.ns and one.ns == Settings(data_dir=tmp_path / "one").ns
    Subjects(one.ns)  # a valid token
    assert Settings(data_dir=tmp_path / "one", namespace="prod").ns == "prod"
    with pytest.raises(ValueError):
        Settings(namespace="a.b")


@pytest.mark.parametrize("bad", ["a.b", "a b", "", "x>"])
def test_ids_that_would_break_subjects_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        subjects.event("models", bad)
    with pytest.raises(ValueError):
        subjects.registry("nonsense", "create")
    with pytest.raises(ValueError):
        Subjects(bad)


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
