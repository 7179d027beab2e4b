"""The scheduler's metrics. Every replica says whether it leads; only the leader reports the
cluster's state (workers and instances by state, and each PENDING instance with the reason it
is not placed), from the fleet its last pass read, so a Prometheus scraping every replica
counts the cluster once.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.services.scheduler.election import PostgresElection
from shoal.services.scheduler.service import SchedulerService
from shoal.shared.states import InstanceState, WorkerState

MAX_REASON = 300
"""Characters of a pending reason kept as a label value."""


class SchedulerCollector(Collector):
    def __init__(self, identity: str, election: PostgresElection,
                 service: SchedulerService) -> None:
        self.identity = identity
        self.election = election
        self.service = service

    def collect(self) -> Iterator[Metric]:
        leading = self.election.term is not None
        yield self._leader_gauge(leading)
        if not leading or self.service.snapshot is None:
            return
        workers, instances = self.service.snapshot
        by_state = GaugeMetricFamily("shoal:workers", "Workers by state.", labels=["state"])
        counts = Counter(w.state for w in workers)
        for state in WorkerState:
            by_state.add_metric([state.value], counts[state])
        yield by_state
        inst = GaugeMetricFamily("shoal:instances", "Instances by model and state.",
                                 labels=["model_name", "state"])
        per_model = Counter((i.model_name, i.state) for i in instances)
        for model in sorted({i.model_name for i in instances}):
            for state in InstanceState:
                inst.add_metric([model, state.value], per_model[(model, state)])
        yield inst
        pending = GaugeMetricFamily("shoal:instance_pending_info",
                                    "PENDING instances, with why they are not placed.",
                                    labels=["model_name", "instance_name", "reason"])
        for i in instances:
            if i.state is InstanceState.PENDING:
                pending.add_metric([i.model_name, i.name, (i.state_message or "")[:MAX_REASON]], 1)
        yield pending

    def _leader_gauge(self, leading: bool) -> GaugeMetricFamily:
        gauge = GaugeMetricFamily("shoal:scheduler_is_leader", "1 on the replica that leads.",
                                  labels=["replica"])
        gauge.add_metric([self.identity], float(leading))
        return gauge
