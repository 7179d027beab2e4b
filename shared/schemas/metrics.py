"""Where a process serves its Prometheus metrics: its answer on shoal.metrics.targets, listed by
a gateway's /metrics/targets in Prometheus' HTTP service-discovery format."""

from __future__ import annotations

from pydantic import Field

from shoal.shared.schemas.common import Wire


class MetricsTarget(Wire):
    service: str
    """gateway, registry, scheduler, worker or engine."""
    address: str
    """host:port where /metrics answers."""
    labels: dict[str, str] = Field(default_factory=dict)
    """What the target is (worker name, instance id, model, scheduler replica)."""
