"""Every NATS subject, queue group and stream name Shoal uses, built by one `Subjects` object per
namespace (README "NATS subjects", the documented surface).

A namespace (SHOAL_NAMESPACE; default derived from the data directory, `Settings.ns`) prefixes
everything a stack puts on NATS, as Dynamo namespaces its components: two stacks sharing one NATS
server never answer each other's requests, share no queue group, and read separate event streams.
Every process gets its `Subjects` from its `Bus` (`bus.subjects`); nobody writes a subject as an
f-string elsewhere. Tokens are `[A-Za-z0-9_-]`; ids are opaque and never contain dots. Renaming a
subject is a wire break: do it only with a version bump.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PREFIX = "shoal"
RESOURCES = ("models", "instances", "workers", "keys", "quota", "usage", "responses")

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def token(value: str, what: str) -> str:
    """`value` when it can be one subject token, else a ValueError naming `what`."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} cannot be a subject token "
                         "(letters, digits, - and _ only)")
    return value


@dataclass(frozen=True)
class Subjects:
    """The names of one namespace: shoal.<namespace>.<component>.<endpoint>."""

    namespace: str

    def __post_init__(self) -> None:
        token(self.namespace, "namespace")

    @property
    def prefix(self) -> str:
        return f"{PREFIX}.{self.namespace}"

    def service(self, name: str) -> str:
        """A NATS micro service's name in this namespace (also its queue group), e.g.
        shoal-registry-<ns>: `$SRV.PING.shoal-registry-<ns>` finds this stack's replicas only."""
        return f"{token(name, 'service')}-{self.namespace}"

    # ------------------------------------------------------------ registry (request/reply)
    @property
    def registry_service(self) -> str:
        return self.service("shoal-registry")

    @property
    def registry_group(self) -> str:
        return f"{self.prefix}.registry"

    def registry(self, resource: str, verb: str) -> str:
        """shoal.<ns>.registry.<resource>.<verb>, e.g. shoal.<ns>.registry.models.create."""
        if resource not in RESOURCES:
            raise ValueError(f"unknown registry resource {resource!r}")
        return f"{self.registry_group}.{resource}.{token(verb, 'verb')}"

    # ------------------------------------------------------------ scheduler (request/reply)
    @property
    def scheduler_service(self) -> str:
        return self.service("shoal-scheduler")

    @property
    def scheduler_group(self) -> str:
        return f"{self.prefix}.scheduler"

    @property
    def scheduler_leader(self) -> str:
        """Who leads, answered by any scheduler replica (standbys too): a SchedulerStatus."""
        return f"{self.scheduler_group}.leader.get"

    @property
    def scheduler_plan(self) -> str:
        """Dry run: where one more instance of a ModelCreate would go now (a PlacementPlan),
        answered by any replica; nothing is written."""
        return f"{self.scheduler_group}.placement.plan"

    # ------------------------------------------------------------ events (JetStream)
    @property
    def events_stream(self) -> str:
        """The namespace's JetStream stream (stream names take no dots)."""
        return f"SHOAL_EVENTS_{self.namespace}"

    def event(self, resource: str, resource_id: str) -> str:
        """shoal.<ns>.events.<resource>.<id>: created/updated/deleted with the new state."""
        return f"{self.prefix}.events.{resource}.{token(resource_id, 'id')}"

    def events_of(self, resource: str | None = None) -> str:
        """Wildcard for a consumer: every event, or every event of one resource."""
        return self.events_all if resource is None else f"{self.prefix}.events.{resource}.*"

    @property
    def events_all(self) -> str:
        return f"{self.prefix}.events.>"

    # ------------------------------------------------------------ workers
    def heartbeat(self, worker_id: str) -> str:
        return f"{self.prefix}.workers.{token(worker_id, 'worker id')}.heartbeat"

    @property
    def heartbeats_all(self) -> str:
        return f"{self.prefix}.workers.*.heartbeat"

    # ------------------------------------------------------------ inference
    def infer(self, instance_id: str) -> str:
        """One instance's generate requests; replies stream to the request's inbox."""
        return f"{self.prefix}.infer.{token(instance_id, 'instance id')}"

    def abort(self, instance_id: str) -> str:
        return f"{self.prefix}.abort.{token(instance_id, 'instance id')}"

    def ranks(self, instance_id: str) -> str:
        """Rank 0's engine answers the rendezvous of a multi-worker instance (RankPlan)."""
        return f"{self.prefix}.ranks.{token(instance_id, 'instance id')}.plan"

    def rank_exits(self, instance_id: str) -> str:
        """A subordinate worker reports a rank of the instance that ended (RankExit)."""
        return f"{self.prefix}.ranks.{token(instance_id, 'instance id')}.exits"

    def load(self, instance_id: str) -> str:
        return f"{self.prefix}.load.{token(instance_id, 'instance id')}"

    @property
    def load_all(self) -> str:
        return f"{self.prefix}.load.*"

    @property
    def autoscale_demand(self) -> str:
        """Published by a gateway holding a request for an autoscaled model that has no running
        instance (ScaleDemand): the scheduler's leader scales it from zero."""
        return f"{self.prefix}.autoscale.demand"

    @property
    def gateway_info(self) -> str:
        """Request, answered by every gateway (GatewayInfo): whether it requires API keys, for
        `shoal keys create`'s warning."""
        return f"{self.prefix}.gateway.info"

    @property
    def metrics_targets(self) -> str:
        """Request, answered by every process that serves /metrics (each replies with its
        address): how a gateway's /metrics/targets lists them for Prometheus."""
        return f"{self.prefix}.metrics.targets"
