"""Scheduler API payloads: who leads the scheduler replicas (shoal.scheduler.leader.get)."""

from __future__ import annotations

from datetime import datetime

from shoal.shared.schemas.common import Wire


class SchedulerStatus(Wire):
    replica: str
    """The replica that answered."""
    is_leader: bool
    leader: str | None = None
    """The leading replica as the answering one last saw it (standbys refresh it every few
    seconds); None while no replica holds the lock."""
    leader_since: datetime | None = None
    """When the answering replica took the lead (only when it is the leader)."""
