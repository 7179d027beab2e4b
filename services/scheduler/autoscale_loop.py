"""The autoscaler on the bus: the leader's loop that reads engine loads (shoal.load.*) and
gateways' demand for models scaled to zero (shoal.autoscale.demand), steps the pure Autoscaler
(autoscale.py) for every model with `autoscaling`, and writes a changed `replicas` through the
registry with the reason as a scale event on the model. The reconcile then creates or deletes
instances as for any replica change.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shoal.services.scheduler.autoscale import Autoscaler, InstanceLoad
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import ShoalError
from shoal.shared.loops import run_every
from shoal.shared.schemas.common import utcnow
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import (
    InstanceFilter, ListRequest, ModelPublic, ModelUpdate, ScaleEvent
)
from shoal.shared.schemas.scheduler import ScaleDemand
from shoal.shared.states import InstanceState

log = logging.getLogger(__name__)
LOAD_FRESH_S = 3.0
"""A load older than this is not used (the engine may be gone)."""
DEMAND_FRESH_S = 5.0
"""A gateway repeats its demand every 2 s while it waits."""


class AutoscaleLoop:
    def __init__(self, registry: RegistryClient, interval: float,
                 kick: Callable[[], None], clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.interval = interval
        self.kick = kick
        self.clock = clock
        self.scaler = Autoscaler()
        self.loads: dict[str, tuple[float, EngineLoad]] = {}
        self.demand: dict[str, float] = {}
        self.subs: list[Subscription] = []
        self.lock = asyncio.Lock()

    async def run(self, bus: Bus, halt: asyncio.Event) -> None:
        self.subs = [await bus.subscribe(bus.subjects.load_all, EngineLoad, self._on_load),
                     await bus.subscribe(bus.subjects.autoscale_demand, ScaleDemand,
                                         self._on_demand)]
        try:  # a failed step is logged; the loop goes on
            await run_every(self.interval, halt, self.step, "autoscale step", log)
        finally:
            for sub in self.subs:
                await sub.unsubscribe()

    async def _on_load(self, load: EngineLoad, _msg: Msg) -> None:
        self.loads[load.instance_id] = (self.clock(), load)

    async def _on_demand(self, demand: ScaleDemand, _msg: Msg) -> None:
        now = self.clock()
        new = now - self.demand.get(demand.model, -math.inf) > DEMAND_FRESH_S
        self.demand[demand.model] = now
        if new:  # a client began waiting (not a gateway's repeat): do not wait for the tick,
            await self.step()  # on every cold start, not only the model's first

    async def step(self) -> None:
        async with self.lock:  # the tick and a demand never decide at once
            await self._step()

    async def _step(self) -> None:
        models = [m for m in await self.registry.list_models(ListRequest(limit=1000))
                  if m.autoscaling is not None]
        self.scaler.forget({m.name for m in models})
        if not models:
            return
        now = self.clock()
        running = await self.registry.list_instances(InstanceFilter(state=InstanceState.RUNNING))
        for model in models:
            if model.scale_events:  # a new leader: the cool-down runs from the last scale
                age = (utcnow() - model.scale_events[-1].at).total_seconds()
                self.scaler.resume(model.name, age, now)
            loads = []
            for inst in running:
                seen = self.loads.get(inst.id)
                if inst.model_id == model.id and seen and now - seen[0] <= LOAD_FRESH_S:
                    x = seen[1]
                    loads.append(InstanceLoad(x.num_running, x.num_waiting, x.kv_cache_usage))
            demand = now - self.demand.get(model.name, -1e9) <= DEMAND_FRESH_S
            assert model.autoscaling is not None
            decision = self.scaler.step(model.name, model.autoscaling, model.replicas, loads,
                                        now, demand)
            if decision is not None:
                await self._apply(model, decision.replicas, decision.reason, now)

    async def _apply(self, model: ModelPublic, replicas: int, reason: str, now: float) -> None:
        event = ScaleEvent(at=utcnow(), from_replicas=model.replicas, to_replicas=replicas,
                           reason=reason)
        try:
            await self.registry.update_model(ModelUpdate(id=model.id, version=model.version,
                                                         replicas=replicas, scale_event=event))
        except ShoalError as exc:  # a stale version (someone changed it): next step re-reads
            log.info("autoscale of %s not written: %s", model.name, exc.message)
            return
        self.scaler.scaled(model.name, now)
        log.info("autoscale %s: %d -> %d replicas (%s)", model.name, model.replicas, replicas,
                 reason)
        self.kick()
