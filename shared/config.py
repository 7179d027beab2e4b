"""Settings: every knob of the control plane, read once from SHOAL_* variables at the process edge.

One `Settings` object is built by the CLI (or a test) and passed down; nothing deeper reads the
environment (docs/architecture.md "Config objects"). Defaults follow GPUStack's timings where
users expect them.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


SECRETS_DIR = Path("/run/secrets")
"""Docker's secrets: a file named like a variable (shoal_database_url) sets it (compose.yaml)."""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SHOAL_", extra="ignore",
                                      secrets_dir=SECRETS_DIR if SECRETS_DIR.is_dir() else None)

    nats_url: str | None = None
    """NATS server(s), comma separated. None: `shoal up` starts an embedded one; other commands
    read the URL `shoal up` wrote to <data_dir>/stack.json."""
    database_url: str | None = None
    """postgresql+asyncpg://... None: embedded PostgreSQL under <data_dir>/postgres."""
    database_wait: float = Field(default=10.0, ge=0.0)
    """Seconds the registry keeps trying its first database connection before it exits (a
    Postgres still starting beside it: compose.yaml gives it 120)."""
    data_dir: Path = Path.home() / ".shoal"
    namespace: str | None = None
    """Prefix of every NATS subject, queue group and stream of this stack (Dynamo's namespace):
    stacks sharing one NATS server never answer each other. None: derived from data_dir (`ns`),
    or the one `shoal up` wrote to stack.json; processes of one cluster on several machines must
    set the same value."""

    nats_stream_replicas: int = Field(default=1, ge=1, le=5)
    """Servers of a NATS cluster that hold the event stream (JetStream's replicas): 3 on a
    three-server cluster (compose.yaml) keeps events and consumers through the loss of one."""

    request_timeout: float = 5.0
    """Seconds a bus request waits for its reply."""
    connect_timeout: float = 10.0
    """Seconds to keep trying the first connection to NATS before giving up."""

    heartbeat_interval: float = 30.0
    """Seconds between a worker's heartbeats (GPUStack: 30 s)."""
    heartbeat_timeout: float = 150.0
    """Silence after which a worker is NOT_READY and its instances UNREACHABLE (GPUStack: 150 s)."""
    heartbeat_check_interval: float = 5.0
    reschedule_after: float = 300.0
    """Seconds an instance may stay UNREACHABLE before the scheduler places it elsewhere."""

    scheduler_interval: float = 5.0
    """Seconds between the scheduler's periodic reconciles (events trigger one sooner)."""
    scheduler_error_backoff: float = 10.0
    """First wait before an ERROR instance is rescheduled; doubles with each attempt."""
    scheduler_error_backoff_max: float = 600.0
    scheduler_autoscale_interval: float = 2.0
    """Seconds between the leader's autoscaling steps (models with `autoscaling`)."""
    scheduler_name: str | None = None
    """This scheduler replica's name in logs and in the leader status; default <hostname>-<pid>."""
    scheduler_election_interval: float = 1.0
    """Seconds between the leader's checks that its Postgres lock connection answers (one slower
    than this steps it down). Standbys wait on the lock itself, so a leader that exits or loses
    its connection is replaced at once, not after this interval."""

    worker_name: str | None = None
    """Defaults to the host name."""
    worker_labels: dict[str, str] = Field(default_factory=dict)
    worker_cpus: list[int] | None = None
    """The CPU cores this worker's engines and ranks run on (SHOAL_WORKER_CPUS='[1]'); the worker
    reports that many cores. Default: every core the agent may use. Two agents on one machine
    split its cores this way, so their engines do not oversubscribe them."""
    distributed_host: str | None = None
    """The address other workers reach this worker by for the rendezvous of an instance whose
    pipeline stages span workers (rank 0's TCPStore, then gloo/NCCL); default this machine's
    host name as it resolves."""
    worker_keep_engines: bool = False
    """A worker agent that is stopped leaves its engines running for the next one to adopt (an
    upgrade in place); one that dies always does."""
    worker_engine_log_stdout: bool = False
    """Copy what each engine writes to its log file onto the worker agent's stdout (compose.yaml
    sets it: a container's stdout is its log, `docker compose logs`); the files stay."""
    simulate_devices: str | None = None
    """e.g. "8xH100-80GB" or "2xA10-24GB,1xcpu": a simulated worker for capacity planning."""

    drain_timeout: float = 30.0
    """Seconds an engine being stopped lets in-flight requests finish before aborting them."""
    model_cache_dir: Path | None = None
    """Converted models (GGUF -> safetensors); default ~/.cache/shoal/models."""
    vllm_venv: Path | None = None
    """A venv with vLLM installed that the vllm backend runs from (SHOAL_VLLM_VENV, the worker's
    --vllm-venv); unset, the worker installs the model's backend_version on first use."""
    backend_cache_dir: Path | None = None
    """Where the worker installs backends (<package>-<version> venvs); default
    <data_dir>/backends."""
    engine_placement_check_interval: float = Field(default=5.0, gt=0.0)
    """Seconds between an engine's checks that its instance is still placed where it runs (and
    after every NATS reconnection): one placed anew meanwhile, on another worker after a
    partition, is fenced (it stops taking requests and drains)."""
    engine_restart_max_backoff: float = 300.0
    """Crashed engines restart after 2, 4, 8, ... seconds, at most this long."""

    gateway_host: str = "127.0.0.1"
    gateway_port: int = 8000
    require_api_key: bool = False
    """When true the gateway refuses requests without a valid API key (401)."""
    api_key: str | None = None
    """A fixed key (vLLM's --api-key): when set, keys are required and this one is valid beside
    those made with `shoal keys create`."""
    gateway_allowed_hosts: str = ""
    """More names the gateway answers to, comma separated (`*`: any), beside localhost, this
    machine's name, its bind and advertised addresses, and any IP address: a request whose Host
    is another name is a 400 (DNS rebinding). Set it to the names clients use (a DNS alias, a
    proxy's name, compose's service name)."""
    gateway_max_outstanding: int = 1024
    """Inference requests one gateway holds at once; beyond it new ones get 429 (bounded memory)."""
    gateway_engine_dead_after: float = 3.0
    """Seconds without a load message (or a stream reply) after which the router avoids an engine
    until it publishes again."""
    gateway_engine_stall_timeout: float = 30.0
    """Seconds without any message from an engine after which its in-flight streams fail (a hung
    engine, a partition). Longer than `gateway_engine_dead_after`: a CPU-starved engine that
    pauses a few seconds keeps its streams. A crash fails them at once (the instance leaves
    RUNNING), and so does a lost NATS connection."""
    gateway_accept_timeout: float = 10.0
    """Seconds to wait for an engine to accept a request (its seq-0 chunk) before trying another."""
    gateway_stream_idle_timeout: float = 300.0
    """Seconds a started stream may go without any message before it is failed (a backstop)."""
    gateway_cold_start_timeout: float = 120.0
    """Seconds a request for an autoscaled model with no running instance waits for one to
    start (scale from zero) before a 503."""
    gateway_embed_timeout: float = 120.0
    """Seconds one batch of /v1/embeddings inputs may take on an engine (queue + compute)."""
    gateway_max_attempts: int = 3
    """Instances tried for a request that has not started yet."""
    gateway_instance_refresh: float = 10.0
    """Seconds between full reloads of the RUNNING instances from the registry (events fill in)."""
    gateway_usage_flush_interval: float = Field(default=1.0, gt=0)
    gateway_usage_flush_requests: int = Field(default=64, ge=1)
    """Usage of keys without limits is summed per key and model and sent to the registry every
    `interval` seconds or `requests` requests, and when the gateway stops; a key with limits has
    each request's usage sent at once (its next admission counts it)."""
    gateway_key_cache_ttl: float = 10.0
    """Seconds a verified API key is trusted before the registry is asked again: only a fallback,
    since every gateway drops a key from its cache when the registry's event for it arrives
    (revoked: refused at once) and empties its cache when it reconnects to NATS."""
    gateway_key_stale_max: float = Field(default=600.0, ge=0.0)
    """Seconds after its last verification a key is still served while the registry cannot
    verify it (Postgres or the registry away: 503): chat with keys outlives a database outage of
    up to this long. Revocation events still apply at once; a key never outlives its expiry; a
    key not verified by this gateway before the outage is refused (503). 0: no stale serving."""
    gateway_max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    """The largest request body the gateway reads (README "The largest request"); larger is a
    413. It must stay under the NATS server's max_payload (8 MiB for the embedded server and in
    compose), which bounds what one bus message carries."""

    metrics_host: str = "127.0.0.1"
    """Where the registry, scheduler, worker and engine processes serve /metrics (the gateway
    serves it on its own port)."""
    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Their /metrics port; 0 = any free one (a gateway's /metrics/targets lists each). Engines
    always take a free one."""
    metrics_advertise_host: str | None = None
    """The host name Prometheus reaches them by; default metrics_host, or this machine's name
    when that is 0.0.0.0."""

    failpoints: list[str] = Field(default_factory=list)
    """Fault injection for tests (SHOAL_FAILPOINTS='["registry.after_commit"]': the registry
    SIGKILLs itself right after a commit, before the event is published). Never set it else."""

    log_level: str = "INFO"
    log_json: bool = False
    otel_exporter: Literal["none", "console", "otlp"] = "none"
    """Where spans go: nowhere, the console, or OTLP (endpoint and protocol from the standard
    OTEL_EXPORTER_OTLP_* variables). Anything else is refused at start."""

    @field_validator("namespace")
    @classmethod
    def _namespace_token(cls, value: str | None) -> str | None:
        if value is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", value):
            raise ValueError("letters, digits, - and _ only (it is a NATS subject token)")
        return value

    @property
    def ns(self) -> str:
        """The namespace in effect: SHOAL_NAMESPACE, else `d` + 10 hex digits of the data dir's
        absolute path (the same for `shoal up`, its services and the CLI on one data dir)."""
        if self.namespace:
            return self.namespace
        path = str(self.data_dir.expanduser().absolute())
        return "d" + hashlib.sha256(path.encode()).hexdigest()[:10]

    @property
    def stack_file(self) -> Path:
        return self.data_dir / "stack.json"
