"""Typed client of the scheduler's bus API (any replica answers, the leader or a standby)."""

from __future__ import annotations

from shoal.shared.bus.client import Bus
from shoal.shared.schemas.common import Empty
from shoal.shared.schemas.registry import ModelCreate
from shoal.shared.schemas.scheduler import PlacementPlan, SchedulerStatus

PLAN_TIMEOUT_S = 30.0
"""A dry run may read a large model's headers for the first time (seconds), so it waits longer
than an ordinary request."""


class SchedulerClient:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus

    async def status(self) -> SchedulerStatus:
        return await self.bus.request(self.bus.subjects.scheduler_leader, Empty(), SchedulerStatus)

    async def plan(self, model: ModelCreate) -> PlacementPlan:
        """Where one more instance of `model` would go now, or why nowhere; nothing is written."""
        return await self.bus.request(self.bus.subjects.scheduler_plan, model, PlacementPlan,
                                      timeout=max(PLAN_TIMEOUT_S,
                                                  self.bus.settings.request_timeout))
