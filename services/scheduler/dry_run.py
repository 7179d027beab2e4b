"""The dry run the scheduler answers on the bus (shoal.scheduler.placement.plan): the same
decision as a reconcile pass, on the registry's current fleet, with nothing written.

The model's files are read here, by the scheduler, because it is the scheduler that will size the
real instance; a caller (the gateway, a dashboard) never needs the files itself.
"""

from __future__ import annotations

import asyncio

from shoal.services.scheduler.planner import Planner, ProfileCache
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.schemas.registry import ListRequest, ModelCreate, WorkerPublic
from shoal.shared.schemas.scheduler import PlacementPlan

PAGE_SIZE = 1000


async def plan_dry_run(registry: RegistryClient, profiles: ProfileCache,
                       model: ModelCreate) -> PlacementPlan:
    """Place one instance of `model` on a snapshot of the fleet. What can never run is a 400
    naming the field, not a plan: a source that cannot be read (`source`), a tp, pp or
    max_model_len the model refuses (claim/runnable.py)."""
    try:
        profile = await asyncio.to_thread(profiles.get, model.source)
    except ShoalError as exc:
        raise InvalidRequest(f"cannot size the model from {model.source}: {exc.message}",
                             param="source") from None
    workers = await _all_workers(registry)
    instances = await registry.list_instances()
    result = Planner(workers, instances, profiles).place(model, profile)  # 400 if it never runs
    names = {w.id: w.name for w in workers}
    placement = result.placement
    idle = placement is not None or Planner(workers, [], profiles).place(model, profile).ok
    return PlacementPlan(fits=placement is not None, fits_when_idle=idle, placement=placement,
                         worker_name=names.get(placement.worker_id) if placement else None,
                         message=result.describe())


async def _all_workers(registry: RegistryClient) -> list[WorkerPublic]:
    rows: list[WorkerPublic] = []
    while True:
        page = await registry.list_workers(ListRequest(limit=PAGE_SIZE, offset=len(rows)))
        rows += page
        if len(page) < PAGE_SIZE:
            return rows
