"""The placement fence over real NATS + Postgres: every placement of an instance gets its own
generation, and a write naming an earlier one (the engine or supervisor of a worker back from a
partition, the instance placed elsewhere meanwhile) is refused, with nothing written."""

from __future__ import annotations

import uuid

import pytest

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import Conflict
from shoal.shared.placement_fence import STALE_PLACEMENT
from shoal.shared.schemas.registry import (
    DeviceStatus, InstanceCreate, InstanceTransition, ModelCreate, Placement, WorkerRegister
)
from shoal.shared.states import InstanceState as S

pytestmark = pytest.mark.integration


async def _worker(client: RegistryClient) -> str:
    worker = await client.register_worker(WorkerRegister(
        name=f"w-{uuid.uuid4().hex[:8]}", hostname="h",
        status=DeviceStatus(cpu_cores=1, memory_total=2**34)))
    return worker.id


async def test_a_write_of_an_earlier_placement_is_refused(client: RegistryClient) -> None:
    model = await client.create_model(ModelCreate(name=f"m-{uuid.uuid4().hex[:8]}",
                                                  source="/models/x"))
    first, second = await _worker(client), await _worker(client)
    inst = await client.create_instance(InstanceCreate(model_id=model.id))
    assert inst.placement_generation == 0
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=S.SCHEDULED, placement=Placement(worker_id=first)))
    old = inst.placement_generation
    assert old > 0
    for state in (S.STARTING, S.RUNNING):  # the engine on `first`, naming its placement
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=state, placement_generation=old))
    # `first` is cut off: UNREACHABLE, rescheduled, placed on `second`
    for move in (dict(state=S.UNREACHABLE), dict(state=S.PENDING),
                 dict(state=S.SCHEDULED, placement=Placement(worker_id=second))):
        inst = await client.transition_instance(InstanceTransition(id=inst.id,
                                                                   version=inst.version, **move))
    assert inst.worker_id == second and inst.placement_generation > old

    # the old engine comes back: its writes are refused, even on a fresh version
    for state in (S.RUNNING, S.ERROR, S.STARTING):
        with pytest.raises(Conflict) as err:
            await client.transition_instance(InstanceTransition(
                id=inst.id, version=inst.version, state=state, placement_generation=old))
        assert err.value.code == STALE_PLACEMENT, err.value
        assert f"generation {old}" in err.value.message
    same = await client.get_instance(inst.id)
    assert (same.state, same.version, same.worker_id) == (S.SCHEDULED, inst.version, second)

    # the new placement's engine writes as usual; unplaced, no placement's write passes
    new = inst.placement_generation
    inst = await client.transition_instance(InstanceTransition(
        id=inst.id, version=inst.version, state=S.STARTING, placement_generation=new))
    inst = await client.transition_instance(InstanceTransition(id=inst.id, version=inst.version,
                                                               state=S.PENDING))
    with pytest.raises(Conflict) as err:
        await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=S.PENDING, placement_generation=new))
    assert err.value.code == STALE_PLACEMENT and "not placed now" in err.value.message
