"""Every NATS subject and stream name Shoal uses, built by functions (README "NATS subjects",
the documented surface).

This module is the documented integration surface: nobody writes a subject as an f-string
elsewhere. Tokens are lowercase `[a-z0-9_]`; ids are opaque and never contain dots. Renaming a
subject is a wire break: do it only with a version bump.
"""

from __future__ import annotations

import re

PREFIX = "shoal"
EVENTS_STREAM = "SHOAL_EVENTS"
REGISTRY_SERVICE = "shoal-registry"
REGISTRY_GROUP = f"{PREFIX}.registry"

RESOURCES = ("models", "instances", "workers", "keys", "quota", "usage")

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")


def _token(value: str, what: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{what} {value!r} cannot be a subject token "
                         "(letters, digits, - and _ only)")
    return value


# ---------------------------------------------------------------- registry (request/reply)
def registry(resource: str, verb: str) -> str:
    """shoal.registry.<resource>.<verb>, e.g. shoal.registry.models.create."""
    if resource not in RESOURCES:
        raise ValueError(f"unknown registry resource {resource!r}")
    return f"{REGISTRY_GROUP}.{resource}.{_token(verb, 'verb')}"


# ---------------------------------------------------------------- scheduler (request/reply)
SCHEDULER_SERVICE = "shoal-scheduler"
SCHEDULER_GROUP = f"{PREFIX}.scheduler"
SCHEDULER_LEADER = f"{SCHEDULER_GROUP}.leader.get"
"""Who leads, answered by any scheduler replica (standbys too): a SchedulerStatus."""
SCHEDULER_PLAN = f"{SCHEDULER_GROUP}.placement.plan"
"""Dry run: where one more instance of a ModelCreate would go now (a PlacementPlan), answered by
any replica; nothing is written."""


# ---------------------------------------------------------------- events (JetStream)
def event(resource: str, resource_id: str) -> str:
    """shoal.events.<resource>.<id>: created/updated/deleted with the new state and version."""
    return f"{PREFIX}.events.{resource}.{_token(resource_id, 'id')}"


def events_of(resource: str | None = None) -> str:
    """Wildcard for a consumer: every event, or every event of one resource."""
    return f"{PREFIX}.events.>" if resource is None else f"{PREFIX}.events.{resource}.*"


EVENTS_ALL = f"{PREFIX}.events.>"


# ---------------------------------------------------------------- workers
def heartbeat(worker_id: str) -> str:
    return f"{PREFIX}.workers.{_token(worker_id, 'worker id')}.heartbeat"


HEARTBEATS_ALL = f"{PREFIX}.workers.*.heartbeat"


# ---------------------------------------------------------------- inference
def infer(instance_id: str) -> str:
    """One instance's generate requests; replies stream to the request's inbox."""
    return f"{PREFIX}.infer.{_token(instance_id, 'instance id')}"


def abort(instance_id: str) -> str:
    return f"{PREFIX}.abort.{_token(instance_id, 'instance id')}"


def load(instance_id: str) -> str:
    return f"{PREFIX}.load.{_token(instance_id, 'instance id')}"


LOAD_ALL = f"{PREFIX}.load.*"

AUTOSCALE_DEMAND = f"{PREFIX}.autoscale.demand"
"""Published by a gateway holding a request for an autoscaled model that has no running
instance (ScaleDemand): the scheduler's leader scales it from zero."""


METRICS_TARGETS = f"{PREFIX}.metrics.targets"
"""Request, answered by every process that serves /metrics (each replies with its address):
how a gateway's /metrics/targets lists them for Prometheus."""
