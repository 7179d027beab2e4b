"""A deployment as every client makes one (the gateway's POST /api/v1/models, `shoal models
deploy`, `shoal serve`): the scheduler's dry run first, so what can never run is refused with the
dry run's own 400 naming the field (a source that cannot be read, a tp the model's heads cannot
split, a max_model_len past the model's), then the registry's create. An update that changes
how the model runs (tp, pp, max_model_len, engine_args, the backend's fields) is checked the
same way.

When no scheduler answers (all replicas restarting, or none started yet), the deploy goes on
unchecked rather than failing: nothing is placed without a scheduler anyway, and the first one
back keeps an instance it can never place PENDING with the reason.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from pydantic import ValidationError

from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import refusal
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.bus.scheduler_client import SchedulerClient
from shoal.shared.errors import Unavailable
from shoal.shared.schemas.registry import RUN_FIELDS, ModelCreate, ModelPublic, ModelUpdate
from shoal.shared.schemas.scheduler import PlacementPlan

log = logging.getLogger(__name__)


async def preflight(bus: Bus, spec: ModelCreate, wait_s: float = 0.0) -> PlacementPlan | None:
    """The scheduler's dry run of `spec`: InvalidRequest (400, naming the field) for what can
    never run; None when no scheduler answers (within `wait_s`: a stack that is starting)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return await SchedulerClient(bus).plan(spec)
        except Unavailable as exc:
            if time.monotonic() >= deadline:
                log.warning("deploying %s unchecked: %s", spec.name, exc.message)
                return None
        await asyncio.sleep(0.2)


async def deploy(bus: Bus, spec: ModelCreate) -> ModelPublic:
    """Create the model once the scheduler has not refused it."""
    await preflight(bus, spec)
    return await RegistryClient(bus).create_model(spec)


async def check_update(bus: Bus, model: ModelPublic, update: ModelUpdate) -> None:
    """An update that changes how the model runs is checked as a deploy of the result would be
    (so a PATCH cannot make a model unrunnable, nor /v1/models advertise such a context): the
    result validated as a create (a 400 naming the field), then the scheduler's dry run."""
    changed = {f for f in RUN_FIELDS if f in update.model_fields_set}
    if not changed:
        return
    merged = {**model.model_dump(mode="json", include=set(ModelCreate.model_fields)),
              **update.model_dump(mode="json", include=changed)}
    try:
        spec = ModelCreate.model_validate_json(json.dumps(merged))
    except ValidationError as exc:
        raise refusal(exc, whole="the updated model") from None
    await preflight(bus, spec)
