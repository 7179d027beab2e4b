"""Instances on the wire: placements and what they claim, the public view, state transitions,
filters, and the leader's fence on the scheduler's writes."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field, field_validator

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry.requests import DeleteRequest
from shoal.shared.states import InstanceState


class ResourceClaim(Wire):
    """What a placed instance takes: bytes per GPU index (VRAM) and RAM."""

    gpu_memory: dict[int, int] = Field(default_factory=dict)
    ram: int = 0

    @field_validator("gpu_memory", mode="before")
    @classmethod
    def _int_keys(cls, value: dict[str | int, int]) -> dict[int, int]:
        return {int(k): v for k, v in (value or {}).items()}


class SubordinateWorker(Wire):
    """A further worker of a multi-worker instance (pipeline stages)."""

    worker_id: str
    worker_name: str
    gpu_indexes: list[int]
    claim: ResourceClaim


class Placement(Wire):
    worker_id: str
    gpu_indexes: list[int] = Field(default_factory=list)
    claim: ResourceClaim = Field(default_factory=ResourceClaim)
    tp: int = 1
    pp: int = 1
    subordinate_workers: list[SubordinateWorker] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    generation: int = 0
    """Set by the registry when the placement is written (the row's version then, so every
    placement of one instance has its own): what a worker's and an engine's writes name, so
    those of an earlier placement (a worker back from a partition) are refused."""


class LeaderFence(Wire):
    """Proof that a write comes from the scheduler that leads now: the Postgres backend pid of
    its lock connection and the token it holds there (shared/db/leader_lock.py). The registry
    refuses a fenced write (409 not_leader) unless that connection holds both locks."""

    pid: int = Field(gt=0)
    token: int = Field(gt=0, lt=2**31)


class InstanceCreate(Wire):
    model_id: str
    fence: LeaderFence | None = None


class InstancePublic(Wire):
    id: str
    name: str
    model_id: str
    model_name: str
    state: InstanceState
    state_message: str | None = None
    worker_id: str | None = None
    worker_name: str | None = None
    gpu_indexes: list[int] = Field(default_factory=list)
    claim: ResourceClaim = Field(default_factory=ResourceClaim)
    tp: int = 1
    pp: int = 1
    subordinate_workers: list[SubordinateWorker] = Field(default_factory=list)
    warnings: list[str] = Field(default_factory=list)
    restart_count: int = 0
    placement_generation: int = 0
    """The current placement's generation (Placement.generation); 0 while PENDING."""
    created_at: datetime
    updated_at: datetime
    state_changed_at: datetime
    version: int
    run_revision: int = 0
    """The model's run_revision it was made for: the scheduler replaces older ones."""


class InstanceTransition(Wire):
    """Move an instance to `state`. Moving to SCHEDULED needs `placement`; to PENDING clears it."""

    id: str
    version: int
    state: InstanceState
    state_message: str | None = None
    placement: Placement | None = None
    restart_count: int | None = Field(default=None, ge=0)
    fence: LeaderFence | None = None
    """Set by the scheduler (only the leader's write is accepted); None for everyone else."""
    placement_generation: int | None = None
    """Set by the worker and the engine: the placement they serve. Refused (409
    stale_placement) once the instance has been placed anew or unplaced since: a stale engine
    back from a partition cannot move the replica that now runs elsewhere."""


class InstanceFilter(Wire):
    model_id: str | None = None
    worker_id: str | None = None
    include_subordinate: bool = False
    """With worker_id: also the instances that worker runs pipeline stages of."""
    state: InstanceState | None = None



class InstanceDelete(DeleteRequest):
    fence: LeaderFence | None = None
