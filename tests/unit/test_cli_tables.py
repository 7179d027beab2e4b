"""The CLI's tables: an instance whose pipeline stages run on several workers names every one of
them (README "Placement": `shoal instances list` shows one instance on both workers)."""

from __future__ import annotations

from datetime import datetime, UTC

from shoal.cli.resources import instances_table
from shoal.shared.schemas.registry import InstancePublic, ResourceClaim, SubordinateWorker
from shoal.shared.states import InstanceState

NOW = datetime(2026, 11, 27, tzinfo=UTC)


def _instance(**fields: object) -> InstancePublic:
    values: dict[str, object] = dict(id="i1", name="smol-pp2-1", model_id="m1",
                                     model_name="smol-pp2", state=InstanceState.RUNNING,
                                     worker_id="w1", worker_name="lead", created_at=NOW,
                                     updated_at=NOW, state_changed_at=NOW, version=1)
    values.update(fields)
    return InstancePublic.model_validate(values)


def test_instances_list_names_the_subordinate_workers() -> None:
    across = _instance(pp=2, subordinate_workers=[
        SubordinateWorker(worker_id="w2", worker_name="second", gpu_indexes=[],
                          claim=ResourceClaim()),
        SubordinateWorker(worker_id="w3", worker_name="third", gpu_indexes=[1],
                          claim=ResourceClaim())])
    row = instances_table([across]).splitlines()[2]
    assert "lead, second, third" in row, row
    assert "-; -; 1" in row, row  # each worker's GPUs, in the same order


def test_a_single_worker_instance_is_shown_as_before() -> None:
    row = instances_table([_instance(gpu_indexes=[0, 1], tp=2)]).splitlines()[2]
    assert " lead " in f"{row} " and "0,1" in row and "tp=2 pp=1" in row, row
    pending = instances_table([_instance(worker_id=None, worker_name=None,
                                         state=InstanceState.PENDING)]).splitlines()[2]
    assert "PENDING" in pending and " - " in pending, pending


def test_no_responders_names_the_namespace_and_compose_s() -> None:
    """The host CLI pointed at the compose stack without SHOAL_NAMESPACE=compose: NATS answers
    "no responders", and the message says which namespace was tried and what compose uses."""
    from shoal.cli.resources import namespace_hint
    from shoal.shared.config import Settings

    settings = Settings(nats_url="nats://shoal:secret@127.0.0.1:4222", namespace="d0123456789")
    hint = namespace_hint("no service answers on shoal.d0123456789.registry.workers.list",
                          settings)
    assert "'d0123456789'" in hint and "SHOAL_NAMESPACE=compose" in hint
    assert "secret" not in hint
    assert namespace_hint("NATS connection lost; retry shortly", settings) == (
        "NATS connection lost; retry shortly")
