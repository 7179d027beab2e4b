"""Workers and their devices on the wire: what an agent registers, heartbeats and leaves with,
and the public view of a worker."""

from __future__ import annotations

from datetime import datetime

from pydantic import Field

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry.requests import NAME_PATTERN
from shoal.shared.states import InstanceState, WorkerState


class GpuDevice(Wire):
    index: int = Field(ge=0)
    name: str
    vendor: str = "nvidia"
    memory_total: int = Field(ge=0)
    memory_used: int = Field(default=0, ge=0)
    utilization: float | None = None


class DeviceStatus(Wire):
    """What a worker has: always CPU and RAM, GPUs when present."""

    cpu_cores: int = Field(ge=0)
    memory_total: int = Field(ge=0)
    memory_used: int = Field(default=0, ge=0)
    gpus: list[GpuDevice] = Field(default_factory=list)


class WorkerRegister(Wire):
    name: str = Field(pattern=NAME_PATTERN)
    hostname: str
    labels: dict[str, str] = Field(default_factory=dict)
    simulated: bool = False
    status: DeviceStatus
    running: list[str] = Field(default_factory=list)
    """Instances whose engines still run on this worker (adopted by a restarted agent): the
    registry leaves them as they are instead of sending them back to STARTING."""


class WorkerLeave(Wire):
    """Sent by a worker agent that stops cleanly: the registry marks the worker NOT_READY at
    once instead of after its heartbeats time out."""

    id: str
    running: list[str] = Field(default_factory=list)
    """Instances whose engines the agent left running (SHOAL_WORKER_KEEP_ENGINES) for the next
    agent to adopt: they stay as they are, serving, instead of going UNREACHABLE."""


class WorkerPublic(Wire):
    id: str
    name: str
    hostname: str
    labels: dict[str, str]
    simulated: bool
    state: WorkerState
    state_message: str | None = None
    status: DeviceStatus
    last_heartbeat_at: datetime | None
    created_at: datetime
    updated_at: datetime
    version: int


class WorkerHeartbeat(Wire):
    """Published on shoal.workers.<worker_id>.heartbeat; the registry records it."""

    worker_id: str
    status: DeviceStatus
    instances: dict[str, InstanceState] = Field(default_factory=dict)
    """The instances this worker runs and the state it sees them in."""
