"""Registry API payloads: models, workers, instances, API keys (create / update / public views).

GPUStack's shape (XCreate / XUpdate / XPublic) without SQLModel: ORM rows never leave the
registry, these do. Byte sizes are ints in bytes; ids are opaque strings without dots.
"""

from __future__ import annotations

from datetime import date, datetime
from enum import Enum
from typing import Annotated, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.engine_args import EngineArgs
from shoal.shared.states import InstanceState, WorkerState

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$"


# ---------------------------------------------------------------- devices and workers
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


# ---------------------------------------------------------------- models
class PlacementStrategy(str, Enum):
    BINPACK = "binpack"
    SPREAD = "spread"


class DeviceKind(str, Enum):
    AUTO = "auto"
    GPU = "gpu"
    CPU = "cpu"


class AutoscaleSpec(Wire):
    """Replicas follow the load the engines publish (shoal.load): the scheduler keeps the metric
    near `target` per instance, within [min_replicas, max_replicas]."""

    min_replicas: int = Field(default=1, ge=0, le=1024)
    """0 allows scaling to zero: after `scale_to_zero_after` idle seconds the model keeps no
    instance, and the first request waits (bounded) while one starts."""
    max_replicas: int = Field(ge=1, le=1024)
    metric: Literal["waiting_per_instance", "kv_cache_usage"] = "waiting_per_instance"
    """Requests waiting in the engines' queues per instance, or the mean KV-cache use (0..1)."""
    target: float = Field(gt=0)
    tolerance: float = Field(default=0.1, ge=0, lt=1)
    """Hysteresis: no change while the metric is within target x (1 +- tolerance)."""
    scale_up_cooldown: float = Field(default=30.0, ge=0)
    """Seconds after any scaling before another scale-up."""
    scale_down_cooldown: float = Field(default=120.0, ge=0)
    """Seconds after any scaling (and of load below target) before a scale-down, one replica at
    a time."""
    scale_to_zero_after: float = Field(default=300.0, gt=0)
    """Idle seconds (nothing running or waiting) before a model with min_replicas 0 goes to 0,
    counted from its RUNNING instances' loads (never from while they start)."""

    @model_validator(mode="after")
    def _bounds(self) -> AutoscaleSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) > max_replicas "
                             f"({self.max_replicas})")
        if self.metric == "kv_cache_usage" and self.target > 1:
            raise ValueError("a kv_cache_usage target is a fraction in (0, 1]")
        return self


class ScaleEvent(Wire):
    """One autoscaling decision, kept on the model (the last MAX_SCALE_EVENTS)."""

    at: datetime
    from_replicas: int
    to_replicas: int
    reason: str


MAX_SCALE_EVENTS = 20


class ModelSpec(Wire):
    """Everything a user sets on a model; shared by create and public views."""

    source: str = Field(min_length=1)
    """A local Hugging Face folder or .gguf file (no hub is reachable)."""
    replicas: int = Field(default=1, ge=0, le=1024)
    """How many instances to run (0 keeps the model without running it)."""
    device: DeviceKind = DeviceKind.AUTO
    """auto: GPUs when one fits, else a CPU worker's RAM."""
    placement_strategy: PlacementStrategy = PlacementStrategy.BINPACK
    """binpack takes the fullest worker that fits first; spread the emptiest."""
    worker_selector: dict[str, str] = Field(default_factory=dict)
    """Labels a worker must carry."""
    gpu_selector: list[str] = Field(default_factory=list)
    """Manual GPU selection: ["worker-name:gpu-index", ...]."""
    gpu_type: str | None = None
    """Only GPUs whose name contains this (case-insensitive), e.g. "H100"."""
    distributed: bool = True
    """Allow spreading one instance over several workers (pipeline stages)."""
    tp: int | None = Field(default=None, ge=1)
    """Tensor-parallel GPUs per stage (unset: the scheduler picks)."""
    pp: int | None = Field(default=None, ge=1)
    """Pipeline stages, on one or several workers (unset: the scheduler picks)."""
    gpu_memory_utilization: float = Field(default=0.9, gt=0.0, le=1.0)
    """The share of each GPU's memory the engine may use."""
    max_model_len: int | None = Field(default=None, ge=1)
    """Longest prompt + answer in tokens (unset: the model's own)."""
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = "auto"
    engine_args: EngineArgs = Field(default_factory=EngineArgs)
    """Engine settings (max_num_seqs, max_num_batched_tokens, kv_cache_memory, ...)."""
    autoscaling: AutoscaleSpec | None = None
    """When set, the scheduler sets `replicas` from the load (docs: README "Autoscaling")."""
    aliases: list[Annotated[str, Field(pattern=NAME_PATTERN)]] = Field(default_factory=list,
                                                                       max_length=16)
    """More names the model answers to (vLLM's `--served-model-name a b`: `b` here): each is
    unique among every model's names and aliases; answers carry the model's own name."""

    @field_validator("aliases")
    @classmethod
    def _aliases_once_each(cls, aliases: list[str]) -> list[str]:
        if len(set(aliases)) != len(aliases):
            raise ValueError("each alias once")
        return aliases

    @model_validator(mode="after")
    def _replicas_within_autoscaling(self) -> ModelSpec:
        """With autoscaling, `replicas` (the count now) stays within its bounds."""
        a = self.autoscaling
        if a is not None and not a.min_replicas <= self.replicas <= a.max_replicas:
            self.replicas = min(max(self.replicas, a.min_replicas), a.max_replicas)
        return self

    @model_validator(mode="after")
    def _fits_without_chunked_prefill(self) -> ModelSpec:
        args = self.engine_args
        if (args.enable_chunked_prefill is False and self.max_model_len is not None
                and args.max_num_batched_tokens is not None
                and args.max_num_batched_tokens < self.max_model_len):
            raise ValueError("without chunked prefill engine_args.max_num_batched_tokens must be "
                             f">= max_model_len ({args.max_num_batched_tokens} < "
                             f"{self.max_model_len})")
        return self

    @model_validator(mode="after")
    def _gguf_blocks_need_a_gguf_source(self) -> ModelSpec:
        if self.engine_args.quantization == "gguf" and not self.source.endswith(".gguf"):
            raise ValueError('engine_args.quantization "gguf" runs a .gguf file\'s own blocks: '
                             f"the source must be a .gguf file, got {self.source!r}")
        return self


class ModelCreate(ModelSpec):
    name: str = Field(pattern=NAME_PATTERN)

    @model_validator(mode="after")
    def _name_is_no_alias(self) -> ModelCreate:
        if self.name in self.aliases:
            raise ValueError(f"aliases: {self.name!r} is the model's name already")
        return self


class ModelUpdate(Wire):
    """A partial update; `version` must be the version the caller read (optimistic)."""

    partial: ClassVar[bool] = True

    id: str
    version: int
    replicas: int | None = Field(default=None, ge=0, le=1024)
    placement_strategy: PlacementStrategy | None = None
    worker_selector: dict[str, str] | None = None
    gpu_selector: list[str] | None = None
    gpu_type: str | None = None
    distributed: bool | None = None
    tp: int | None = Field(default=None, ge=1)
    pp: int | None = Field(default=None, ge=1)
    gpu_memory_utilization: float | None = Field(default=None, gt=0.0, le=1.0)
    max_model_len: int | None = Field(default=None, ge=1)
    engine_args: EngineArgs | None = None
    autoscaling: AutoscaleSpec | None = None
    aliases: list[Annotated[str, Field(pattern=NAME_PATTERN)]] | None = Field(default=None,
                                                                              max_length=16)
    scale_event: ScaleEvent | None = None
    """Set by the scheduler's autoscaler with `replicas`: why it scaled (kept on the model)."""


class ModelPublic(ModelSpec):
    id: str
    name: str
    created_at: datetime
    updated_at: datetime
    version: int
    scale_events: list[ScaleEvent] = Field(default_factory=list)
    """The autoscaler's last decisions, oldest first: when, from, to, and why."""


# ---------------------------------------------------------------- instances
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
    created_at: datetime
    updated_at: datetime
    state_changed_at: datetime
    version: int


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


class InstanceFilter(Wire):
    model_id: str | None = None
    worker_id: str | None = None
    include_subordinate: bool = False
    """With worker_id: also the instances that worker runs pipeline stages of."""
    state: InstanceState | None = None


# ---------------------------------------------------------------- API keys
SECRET_PREFIX = "sk-shoal-"
"""Every secret the registry makes begins so: a gateway can tell a Shoal key from a placeholder
token (vLLM's `EMPTY`) without asking, and refuse the latter where keys are required."""


class ApiKeyScope(str, Enum):
    INFERENCE = "inference"
    """The OpenAI-compatible API (/v1/*, /tokenize, /detokenize) only."""
    ADMIN = "admin"
    """Everything: inference and the management API (/api/v1/*, the dashboard's data)."""


class KeyLimit(Wire):
    """Limits of one key on one model (`model` set) or on all its models together (unset).
    Each number is optional; unset means unlimited."""

    model: str | None = None
    rpm: int | None = Field(default=None, ge=1)
    """Requests per minute (fixed one-minute windows)."""
    tpm: int | None = Field(default=None, ge=1)
    """Tokens per minute: prompt + output tokens of the requests finished in the window."""
    token_budget: int | None = Field(default=None, ge=1)
    """Total tokens (prompt + output) ever; spent, the key gets 429 insufficient_quota."""

    @model_validator(mode="after")
    def _some_limit(self) -> KeyLimit:
        if self.rpm is None and self.tpm is None and self.token_budget is None:
            raise ValueError("a limit needs rpm, tpm or token_budget")
        return self


def _distinct_scopes(limits: list[KeyLimit]) -> list[KeyLimit]:
    seen = [limit.model for limit in limits]
    if len(seen) != len(set(seen)):
        raise ValueError("one limit per model (and one for all models)")
    return limits


class ApiKeyCreate(Wire):
    name: str = Field(pattern=NAME_PATTERN)
    expires_at: datetime | None = None
    scope: ApiKeyScope | None = None
    """Unset: admin while no usable admin key exists (the bootstrap key), else inference."""
    limits: list[KeyLimit] = Field(default_factory=list, max_length=64)

    @field_validator("limits")
    @classmethod
    def _check_limits(cls, limits: list[KeyLimit]) -> list[KeyLimit]:
        return _distinct_scopes(limits)


class ApiKeyUpdate(Wire):
    """Change a key's scope or replace its limits (send the version you read)."""

    partial: ClassVar[bool] = True

    id: str
    """The key's id, or its name (the registry resolves it)."""
    version: int | None = None
    """The version read (a stale one: 409); unset: no check."""
    scope: ApiKeyScope | None = None
    limits: list[KeyLimit] | None = Field(default=None, max_length=64)

    @field_validator("limits")
    @classmethod
    def _check_limits(cls, limits: list[KeyLimit] | None) -> list[KeyLimit] | None:
        return None if limits is None else _distinct_scopes(limits)


class ApiKeyPublic(Wire):
    id: str
    name: str
    prefix: str
    """The first characters of the secret, to recognise a key; never enough to use it."""
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    scope: ApiKeyScope = ApiKeyScope.ADMIN
    limits: list[KeyLimit] = Field(default_factory=list)
    version: int


class ApiKeyCreated(ApiKeyPublic):
    secret: str
    """Shown once: only its hash is stored."""


class ApiKeyVerify(Wire):
    secret: str


class ApiKeyVerified(Wire):
    valid: bool
    key_id: str | None = None
    name: str | None = None
    scope: ApiKeyScope | None = None
    has_limits: bool = False
    """The gateway asks the registry's quota before each request only for such keys."""
    expires_in: float | None = None
    """Seconds until a valid key expires (None: never): a gateway caches it no longer."""


# ---------------------------------------------------------------- quotas and usage
class QuotaAcquire(Wire):
    """Before a request: count it against the key's limits for `model` (all or nothing)."""

    key_id: str
    model: str


class QuotaGrant(Wire):
    """The answer: allowed or not, and what OpenAI's x-ratelimit-* headers report (the tightest
    of the key's request and token limits that apply; None where none applies)."""

    allowed: bool
    code: str | None = None
    """rate_limit_exceeded (requests or tokens per minute) or insufficient_quota (budget)."""
    message: str | None = None
    retry_after: float | None = None
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None


class UsageRecord(Wire):
    """After a request: its tokens, added to the key's usage of the day and its token windows."""

    key_id: str
    model: str
    requests: int = Field(default=1, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    batch_id: str | None = Field(default=None, min_length=1, max_length=32)
    """Set by the sender once per record and kept across its retries: the registry counts a
    batch id once (a retry after a reply that timed out, though the write committed, is a no-op).
    """


class UsageQuery(Wire):
    key_id: str | None = None
    model: str | None = None
    since: date | None = None
    until: date | None = None


class UsageRow(Wire):
    key_id: str
    key_name: str
    model: str
    day: date
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class UsageReport(Wire):
    rows: list[UsageRow]


# ---------------------------------------------------------------- generic requests
class ById(Wire):
    id: str


class ByIdOrName(Wire):
    id: str | None = None
    name: str | None = None


class DeleteRequest(Wire):
    id: str
    version: int | None = None
    """When given, refused if the row changed since (optimistic)."""


class InstanceDelete(DeleteRequest):
    fence: LeaderFence | None = None


class Deleted(Wire):
    id: str
    deleted: bool = True


class ListRequest(Wire):
    limit: int = Field(default=1000, ge=1, le=10000)
    offset: int = Field(default=0, ge=0)
