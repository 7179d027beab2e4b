"""Change events on shoal.events.<resource>.<id> (JetStream stream SHOAL_EVENTS).

Each carries the new state of the row and its version, so a consumer can drop stale or
duplicate deliveries by comparing versions.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry import ApiKeyPublic, InstancePublic, ModelPublic, WorkerPublic


class EventKind(str, Enum):
    CREATED = "created"
    UPDATED = "updated"
    DELETED = "deleted"


class ModelEvent(Wire):
    resource: Literal["models"] = "models"
    kind: EventKind
    id: str
    version: int
    data: ModelPublic


class InstanceEvent(Wire):
    resource: Literal["instances"] = "instances"
    kind: EventKind
    id: str
    version: int
    data: InstancePublic


class WorkerEvent(Wire):
    resource: Literal["workers"] = "workers"
    kind: EventKind
    id: str
    version: int
    data: WorkerPublic


class ApiKeyEvent(Wire):
    resource: Literal["keys"] = "keys"
    kind: EventKind
    id: str
    version: int
    data: ApiKeyPublic


Event = ModelEvent | InstanceEvent | WorkerEvent | ApiKeyEvent
EVENT_TYPES: dict[str, type[Wire]] = {
    "models": ModelEvent, "instances": InstanceEvent, "workers": WorkerEvent, "keys": ApiKeyEvent,
}
