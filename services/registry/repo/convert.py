"""Rows to public views. The only place that knows both the ORM rows and the wire schemas."""

from __future__ import annotations

from shoal.shared.db.tables import ApiKeyRow, InstanceRow, ModelRow, WorkerRow
from shoal.shared.schemas.registry import (
    ApiKeyPublic, DeviceStatus, InstancePublic, ModelPublic, Placement, WorkerPublic
)
from shoal.shared.states import InstanceState, WorkerState


def model_public(row: ModelRow) -> ModelPublic:
    return ModelPublic(id=row.id, name=row.name, created_at=row.created_at,
                       updated_at=row.updated_at, version=row.version,
                       scale_events=row.scale_events or [], run_revision=row.run_revision or 0,
                       **row.spec)


def worker_public(row: WorkerRow) -> WorkerPublic:
    return WorkerPublic(
        id=row.id, name=row.name, hostname=row.hostname, labels=row.labels, simulated=row.simulated,
        state=WorkerState(row.state), state_message=row.state_message,
        status=DeviceStatus.model_validate(row.status), last_heartbeat_at=row.last_heartbeat_at,
        created_at=row.created_at, updated_at=row.updated_at, version=row.version,
    )


def instance_public(row: InstanceRow) -> InstancePublic:
    placement = Placement.model_validate(row.placement) if row.placement else None
    return InstancePublic(
        id=row.id, name=row.name, model_id=row.model_id, model_name=row.model_name,
        state=InstanceState(row.state), state_message=row.state_message,
        worker_id=row.worker_id, worker_name=row.worker_name,
        gpu_indexes=placement.gpu_indexes if placement else [],
        claim=placement.claim if placement else {},
        tp=placement.tp if placement else 1, pp=placement.pp if placement else 1,
        subordinate_workers=placement.subordinate_workers if placement else [],
        warnings=placement.warnings if placement else [],
        restart_count=row.restart_count,
        placement_generation=placement.generation if placement else 0,
        created_at=row.created_at, updated_at=row.updated_at,
        state_changed_at=row.state_changed_at, version=row.version,
        run_revision=row.run_revision or 0,
    )


def api_key_public(row: ApiKeyRow) -> ApiKeyPublic:
    return ApiKeyPublic(id=row.id, name=row.name, prefix=row.prefix, created_at=row.created_at,
                        expires_at=row.expires_at, revoked_at=row.revoked_at,
                        scope=row.scope, limits=row.limits or [], version=row.version)
