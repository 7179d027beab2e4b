"""Scheduler API payloads: who leads the scheduler replicas (shoal.scheduler.leader.get) and the
dry run of a placement (shoal.scheduler.placement.plan)."""

from __future__ import annotations

from datetime import datetime

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry import Placement


class SchedulerStatus(Wire):
    replica: str
    """The replica that answered."""
    is_leader: bool
    leader: str | None = None
    """The leading replica as the answering one last saw it (standbys refresh it every few
    seconds); None while no replica holds the lock."""
    leader_since: datetime | None = None
    """When the answering replica took the lead (only when it is the leader)."""


class PlacementPlan(Wire):
    """Where one more instance of a model would go on the fleet as it is now, or why nowhere."""

    fits: bool
    fits_when_idle: bool = True
    """Whether it would fit on the current workers were nothing placed on them: false means no
    worker there can ever hold it as it is (it waits PENDING for a larger one to join)."""
    placement: Placement | None = None
    worker_name: str | None = None
    """The name of `placement.worker_id` (the first stage's worker)."""
    message: str
    """The scheduler's own words: the placement and what it claims, or the PENDING reason."""


class ScaleDemand(Wire):
    """On shoal.autoscale.demand: a gateway waits with a request for `model`, which has no
    running instance (scale from zero)."""

    model: str
