"""Models on the wire: what a user sets (ModelSpec, with its checks), create / update / public
views, and autoscaling with its scale events."""

from __future__ import annotations

from datetime import datetime
from enum import Enum
from typing import Annotated, ClassVar, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from shoal.shared.schemas.backends import (
    BackendCommand, BackendEnv, BackendKind, BackendParameters, BackendVersion, ExtendedKVCache,
    HealthPath, reasoning_parser_of, tool_call_parser_of
)
from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.engine_args import EngineArgs
from shoal.shared.schemas.registry.requests import NAME_PATTERN


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


class LoRAModule(Wire):
    """One LoRA adapter of a model (vLLM's --lora-modules JSON form): requests whose `model`
    is `name` run the base model with this adapter."""

    name: str = Field(pattern=NAME_PATTERN)
    path: str = Field(min_length=1)
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) as the workers see it."""
    base_model_name: str | None = None


class ModelSpec(Wire):
    """Everything a user sets on a model; shared by create and public views."""

    source: str = Field(min_length=1)
    """Where the weights come from, as the workers see it: a Hugging Face model folder, a .gguf
    file, or a Hugging Face id (org/name: found in the Hugging Face cache, else downloaded when
    the hub can be reached)."""
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
    lora_modules: list[LoRAModule] = Field(default_factory=list, max_length=256)
    """LoRA adapters every instance serves (vLLM's --lora-modules; GPUStack's lora list): a
    request naming one runs on this model's instances with it. Needs engine_args.enable_lora."""

    backend: BackendKind = BackendKind.SHOAL
    """What serves it: shoal (our engine), vllm (vLLM's OpenAI server, installed by the worker)
    or custom (`backend_command`, any OpenAI-compatible server). README "Backends"."""
    backend_version: BackendVersion | None = None
    """vllm: the version the worker installs (unset: the worker's default)."""
    backend_parameters: BackendParameters = Field(default_factory=list)
    """Raw flags passed through to the backend, e.g. ["--max-num-seqs 8"]; flags Shoal computes
    (parallelism, port, host, served name, model, ...) are refused."""
    env: BackendEnv = Field(default_factory=dict)
    """Environment of the backend process (and of our engine's)."""
    backend_command: BackendCommand | None = None
    """custom: the server command, with {model_path}, {port}, {served_name}, {host},
    {model_name}, {data_dir} placeholders."""
    backend_health_path: HealthPath = "/health"
    """custom: the path that answers 200 once the server serves."""
    extended_kv_cache: ExtendedKVCache | None = None
    """vllm on NVIDIA / AMD GPUs: LMCache in CPU RAM (`--kv-transfer-config`)."""

    @model_validator(mode="after")
    def _backend_settings_fit(self) -> ModelSpec:
        if self.backend is BackendKind.CUSTOM and self.backend_command is None:
            raise ValueError("backend custom needs backend_command (the server's command line)")
        if self.backend is not BackendKind.CUSTOM and self.backend_command is not None:
            raise ValueError("backend_command is for backend custom")
        if self.backend is BackendKind.SHOAL and (self.backend_parameters
                                                  or self.backend_version):
            raise ValueError("backend_parameters and backend_version are for the vllm and "
                             "custom backends; our engine takes engine_args")
        return self

    @field_validator("backend_parameters")
    @classmethod
    def _one_tool_call_parser(cls, parameters: list[str], info: ValidationInfo) -> list[str]:
        given = tool_call_parser_of(parameters)
        args = info.data.get("engine_args")  # declared before: validated already
        named = args.tool_call_parser if isinstance(args, EngineArgs) else None
        if given is not None and named is not None and given != named:
            raise ValueError(f"--tool-call-parser {given} and engine_args tool_call_parser "
                             f"{named} disagree; give one")
        given = reasoning_parser_of(parameters)
        named = args.reasoning_parser if isinstance(args, EngineArgs) else None
        if given is not None and named is not None and given != named:
            raise ValueError(f"--reasoning-parser {given} and engine_args reasoning_parser "
                             f"{named} disagree; give one")
        return parameters

    def spans_workers(self) -> bool:
        """May one instance span several workers: `distributed`, and our engine or vLLM (over
        Ray: its head on the main worker, followers on the others); a custom server runs in one
        process."""
        return self.distributed and self.backend is not BackendKind.CUSTOM

    def one_worker_reason(self) -> str:
        """Why spans_workers() is False, for a placement's reason."""
        if not self.distributed:
            return "distributed=false"
        return f"backend {self.backend.value}: a custom server runs as one process on one worker"

    def tool_call_parser(self) -> str | None:
        """The parser of "auto" tool choice answers: engine_args', else a backend's
        `--tool-call-parser` (as vLLM users give it, with --enable-auto-tool-choice)."""
        return (self.engine_args.tool_call_parser
                or tool_call_parser_of(self.backend_parameters))

    def reasoning_parser(self) -> str | None:
        """The parser splitting chat reasoning: engine_args', else a backend's
        `--reasoning-parser`."""
        return (self.engine_args.reasoning_parser
                or reasoning_parser_of(self.backend_parameters))

    @field_validator("aliases")
    @classmethod
    def _aliases_once_each(cls, aliases: list[str]) -> list[str]:
        if len(set(aliases)) != len(aliases):
            raise ValueError("each alias once")
        return aliases

    @model_validator(mode="after")
    def _lora_modules_need_lora(self) -> ModelSpec:
        if self.lora_modules and not self.engine_args.enable_lora:
            raise ValueError("lora_modules need engine_args.enable_lora (vLLM's --enable-lora)")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError("lora_modules: each adapter name once")
        return self

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


RUN_FIELDS = ("tp", "pp", "max_model_len", "gpu_memory_utilization", "engine_args",
              "backend", "backend_version", "backend_parameters", "env",
              "backend_command", "backend_health_path", "extended_kv_cache")
"""The ModelUpdate fields that change how the model's engines (or backends) run: an update of
one is checked as a deploy would be (shared/bus/deploy.py) and rolls the instances. Not
lora_modules: running engines reread them when a request names an adapter they do not know
(/v1/load_lora_adapter changes them at runtime; a restart per adapter would drop traffic)."""


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
    lora_modules: list[LoRAModule] | None = Field(default=None, max_length=256)
    backend: BackendKind | None = None
    backend_version: BackendVersion | None = None
    backend_parameters: BackendParameters | None = None
    env: BackendEnv | None = None
    backend_command: BackendCommand | None = None
    backend_health_path: HealthPath | None = None
    extended_kv_cache: ExtendedKVCache | None = None
    """The backend's fields, checked as on a create; the result must fit as a whole too (the
    registry validates the updated spec: backend_parameters on backend shoal is a 400)."""
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
    run_revision: int = 0
    """Bumped by each update that changes how the model runs (RUN_FIELDS): instances made for
    an older one are replaced, one at a time (README "Updating a model")."""
