"""Registry API payloads: models, workers, instances, API keys (create / update / public views).

GPUStack's shape (XCreate / XUpdate / XPublic) without SQLModel: ORM rows never leave the
registry, these do. Byte sizes are ints in bytes; ids are opaque strings without dots.

One module per resource: `workers` (and their devices), `models` (and autoscaling),
`instances` (placements, transitions, the leader's fence), `keys` (API keys, quotas, usage),
`requests` (by id, delete, list pages). This package exports all of their public names, so
callers import from `shoal.shared.schemas.registry` as one API.
"""

from __future__ import annotations

from shoal.shared.schemas.registry.requests import (
    NAME_PATTERN, ById, ByIdOrName, DeleteRequest, Deleted, ListRequest,
)
from shoal.shared.schemas.registry.workers import (
    GpuDevice, DeviceStatus, WorkerRegister, WorkerLeave, WorkerPublic, WorkerHeartbeat,
)
from shoal.shared.schemas.registry.models import (
    PlacementStrategy, DeviceKind, AutoscaleSpec, ScaleEvent, MAX_SCALE_EVENTS, ModelSpec,
    ModelCreate, ModelUpdate, ModelPublic, RUN_FIELDS, LoRAModule,
)
from shoal.shared.schemas.registry.instances import (
    ResourceClaim, SubordinateWorker, Placement, LeaderFence, InstanceCreate, InstancePublic,
    InstanceTransition, InstanceFilter, InstanceDelete,
)
from shoal.shared.schemas.registry.keys import (
    MAX_LIMIT, SECRET_PREFIX, ApiKeyScope, KeyLimit, ApiKeyCreate, ApiKeyUpdate, ApiKeyPublic,
    ApiKeyCreated, ApiKeyVerify, ApiKeyVerified, QuotaAcquire, QuotaGrant, UsageRecord,
    UsageQuery, UsageRow, UsageReport,
)
from shoal.shared.schemas.registry.responses import (
    RESPONSE_ID_PATTERN, StoredResponse, ResponseRef,
)

__all__ = [
    "NAME_PATTERN", "ById", "ByIdOrName", "DeleteRequest", "Deleted", "ListRequest", "GpuDevice",
    "DeviceStatus", "WorkerRegister", "WorkerLeave", "WorkerPublic", "WorkerHeartbeat",
    "PlacementStrategy", "DeviceKind", "AutoscaleSpec", "ScaleEvent", "MAX_SCALE_EVENTS",
    "ModelSpec", "ModelCreate", "ModelUpdate", "ModelPublic", "RUN_FIELDS", "LoRAModule",
    "ResourceClaim",
    "SubordinateWorker",
    "Placement", "LeaderFence", "InstanceCreate", "InstancePublic", "InstanceTransition",
    "InstanceFilter", "InstanceDelete", "MAX_LIMIT", "SECRET_PREFIX", "ApiKeyScope", "KeyLimit",
    "ApiKeyCreate", "ApiKeyUpdate", "ApiKeyPublic", "ApiKeyCreated", "ApiKeyVerify",
    "ApiKeyVerified", "QuotaAcquire", "QuotaGrant", "UsageRecord", "UsageQuery", "UsageRow",
    "UsageReport", "RESPONSE_ID_PATTERN", "StoredResponse", "ResponseRef",
]
