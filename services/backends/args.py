"""The command line and environment of a backend process, from the model and its placement.

Pure (no network, no files): what GPUStack's VLLMServer computes for a vLLM instance, learned
from it and written for Shoal's placement. Parallel sizes come from the placement (tp x pp; pp
over workers runs Ray: its head on the main worker, followers on the subordinates), the memory
flags from the claim (`--gpu-memory-utilization`, `--max-model-len`; on CPU
`VLLM_CPU_KVCACHE_SPACE` and the claimed cores in `VLLM_CPU_OMP_THREADS_BIND`), the names
(`--served-model-name NAME ALIASES...`) and the port from the worker. The model's own
`backend_parameters` come last but for host, port and names, which nobody else sets (a deploy
refuses them: shared/schemas/backends.py).
"""

from __future__ import annotations

import json
import math
import shlex
from dataclasses import dataclass, field

from shoal.shared.schemas.backends import PLACEHOLDERS, find_flag, flatten_parameters
from shoal.shared.schemas.speculative import SpeculativeConfig

GIB = 1 << 30
VLLM_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
"""vLLM's OpenAI server as a module: the `vllm` console script of vllm-cpu fails on its
package name, the module runs from any build."""
LMCACHE_CONNECTOR = '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'
LMCACHE_VENDORS = ("nvidia", "amd")
RAY_PORTS = 12
"""Ports of a Ray node from the start of its range: GCS, client, dashboard, dashboard gRPC,
agent gRPC, agent HTTP, metrics, node manager, object manager, runtime env agent, then the
workers' range."""
RAY_WORKER_PORTS = 100
"""The width of a node's worker port range (above its RAY_PORTS)."""
RAY_JOIN_ENV = {"RAY_gcs_rpc_server_reconnect_timeout_s": "10"}
"""A follower whose head does not answer gives up after 10 s (Ray's default is 60): its
instance's ERROR comes in seconds, with the follower's log."""


@dataclass(frozen=True)
class Stage:
    """One worker of a placement: its address and the GPUs it lends."""

    host: str
    gpu_indexes: tuple[int, ...] = ()
    gpu_memory: int = 0
    """Bytes claimed on this worker's GPUs in all (LMCache's ram_ratio reads it)."""


@dataclass(frozen=True)
class VllmLaunch:
    """What a vLLM instance's argument building reads (all of it known on the worker)."""

    python: str
    model_path: str
    served_names: tuple[str, ...]
    port: int
    main: Stage
    subordinates: tuple[Stage, ...] = ()
    tp: int = 1
    pp: int = 1
    device: str = "gpu"
    """'gpu' or 'cpu'."""
    gpu_vendor: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    gpu_memory_utilization: float | None = None
    kv_cache_bytes: int = 0
    """CPU: the claim's KV cache (VLLM_CPU_KVCACHE_SPACE, whole GiB, at least 1)."""
    cpu_cores: tuple[int, ...] = ()
    backend_version: str | None = None
    backend_parameters: tuple[str, ...] = ()
    engine_args: dict[str, object] = field(default_factory=dict)
    """The model's engine_args that vLLM has a flag for (max_num_seqs, ...), as set."""
    speculative: SpeculativeConfig | None = None
    draft_model_path: str | None = None
    extended_kv_cache: dict[str, float | int | None] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cache_dir: str | None = None
    distributed_port: int | None = None
    """A further free port of the main worker: VLLM_PORT for the ranks' rendezvous."""
    ray_port: int = 41000
    """The start of the Ray port range (RAY_PORTS ports and the workers' range above)."""


@dataclass(frozen=True)
class Command:
    argv: list[str]
    env: dict[str, str]
    injected: list[str] = field(default_factory=list)
    """The flags Shoal added (for the instance's message and the dry run)."""
    warnings: list[str] = field(default_factory=list)
    keep_cwd: bool = False
    """Run in the worker's folder (a custom command may name paths relative to it)."""


def version_tuple(version: str | None) -> tuple[int, ...] | None:
    if not version:
        return None
    parts = []
    for piece in version.split("+")[0].split("."):
        digits = "".join(c for c in piece if c.isdigit())
        if not digits:
            break
        parts.append(int(digits))
    return tuple(parts) or None


def _at_least(version: str | None, minimum: tuple[int, ...]) -> bool:
    """Unknown versions count as new: the worker installs a known one."""
    v = version_tuple(version)
    return v is None or v >= minimum


def is_distributed(launch: VllmLaunch) -> bool:
    return bool(launch.subordinates)


def parallel_args(launch: VllmLaunch) -> list[str]:
    """The placement's sizes: none on one GPU, tp on one worker's GPUs, tp and pp (pipeline
    stages over the workers) across workers."""
    if is_distributed(launch):
        return ["--tensor-parallel-size", str(launch.tp), "--pipeline-parallel-size",
                str(launch.pp), "--distributed-executor-backend", "ray"]
    args = []
    if launch.tp > 1:
        args += ["--tensor-parallel-size", str(launch.tp)]
    if launch.pp > 1:
        args += ["--pipeline-parallel-size", str(launch.pp)]
    return args


def speculative_args(spec: SpeculativeConfig | None, draft_path: str | None,
                     warnings: list[str]) -> list[str]:
    """The model's speculative_config in vLLM's own words (ngram lookup, a draft model)."""
    if spec is None:
        return []
    if spec.method == "layer_skip":
        warnings.append("vLLM has no layer_skip speculation: serving without it")
        return []
    config: dict[str, object] = {"method": spec.method,
                                 "num_speculative_tokens": spec.num_speculative_tokens}
    if spec.method == "ngram":
        config["prompt_lookup_min"] = spec.prompt_lookup_min
        config["prompt_lookup_max"] = spec.prompt_lookup_max
    if spec.method == "draft_model":
        config["model"] = draft_path or spec.model
    if spec.disable_by_batch_size is not None:
        config["disable_by_batch_size"] = spec.disable_by_batch_size
    return ["--speculative-config", json.dumps(config, separators=(",", ":"))]


ENGINE_FLAGS = {"max_num_seqs": "--max-num-seqs",
                "max_num_batched_tokens": "--max-num-batched-tokens",
                "enable_prefix_caching": "--enable-prefix-caching",
                "enable_chunked_prefill": "--enable-chunked-prefill",
                "enforce_eager": "--enforce-eager", "seed": "--seed"}
"""engine_args that mean the same in vLLM (the claim reads the batch limits, so vLLM gets
the same)."""


def engine_flags(values: dict[str, object], given: list[str]) -> list[str]:
    args: list[str] = []
    for name, flag in ENGINE_FLAGS.items():
        value = values.get(name)
        if value is None or find_flag(given, flag[2:]) is not None:
            continue
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        else:
            args += [flag, str(value)]
    return args


def cpu_bind(cores: tuple[int, ...]) -> str:
    """Cores as vLLM's VLLM_CPU_OMP_THREADS_BIND list: "0-3,6"."""
    ranges: list[str] = []
    for core in sorted(set(cores)):
        if ranges and core == int(ranges[-1].split("-")[-1]) + 1:
            ranges[-1] = f"{ranges[-1].split('-')[0]}-{core}"
        else:
            ranges.append(str(core))
    return ",".join(ranges)


def vllm_env(launch: VllmLaunch, warnings: list[str]) -> dict[str, str]:
    """The process's environment on the main worker; the model's `env` wins over each default."""
    env: dict[str, str] = {}
    if launch.device == "cpu":
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(launch.kv_cache_bytes / GIB)))
        if launch.cpu_cores:
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind(launch.cpu_cores)
    else:
        env["OMP_NUM_THREADS"] = "1"  # vLLM's ranks each take a core: OpenMP only contends
        if launch.main.gpu_indexes:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, launch.main.gpu_indexes))
    if launch.cache_dir:
        env["VLLM_CACHE_ROOT"] = launch.cache_dir  # the compile cache outlives a restart
    env.update(lmcache_env(launch, warnings))
    if is_distributed(launch):
        env.update(VLLM_HOST_IP=launch.main.host, RAY_LOG_TO_STDERR="0",
                   RAY_BACKEND_LOG_LEVEL="warning")
        if launch.distributed_port is not None:
            env["VLLM_PORT"] = str(launch.distributed_port)
    env.update(launch.env)
    if is_distributed(launch):  # this instance's head, whatever else the machine runs
        env["RAY_ADDRESS"] = f"{launch.main.host}:{launch.ray_port}"
    return env


def lmcache_env(launch: VllmLaunch, warnings: list[str]) -> dict[str, str]:
    kv = launch.extended_kv_cache
    if kv is None:
        return {}
    env: dict[str, str] = {}
    if kv.get("chunk_size"):
        env["LMCACHE_CHUNK_SIZE"] = str(kv["chunk_size"])
    if kv.get("ram_size_gib"):
        env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = _gib_text(float(kv["ram_size_gib"] or 0))
    elif kv.get("ram_ratio"):
        claimed = launch.main.gpu_memory * float(kv["ram_ratio"] or 0)
        env["LMCACHE_MAX_LOCAL_CPU_SIZE"] = _gib_text(claimed / GIB)
    return env


def _gib_text(gib: float) -> str:
    return str(int(gib)) if gib == int(gib) else f"{gib:.2f}"


def build_vllm(launch: VllmLaunch) -> Command:
    """vLLM's OpenAI server for the main worker of the placement."""
    warnings: list[str] = []
    given = flatten_parameters(list(launch.backend_parameters))
    injected: list[str] = []
    if launch.dtype != "auto":
        injected += ["--dtype", launch.dtype]
    if launch.max_model_len is not None:
        injected += ["--max-model-len", str(launch.max_model_len)]
    if launch.device == "gpu" and launch.gpu_memory_utilization is not None:
        injected += ["--gpu-memory-utilization", f"{launch.gpu_memory_utilization:.4g}"]
    injected += parallel_args(launch)
    injected += engine_flags(launch.engine_args, given)
    if find_flag(given, "speculative-config") is None:
        injected += speculative_args(launch.speculative, launch.draft_model_path, warnings)
    if (_at_least(launch.backend_version, (0, 16, 0))
            and find_flag(given, "disable-access-log-for-endpoints") is None):
        injected += ["--disable-access-log-for-endpoints", "/metrics"]  # scraped often
    if (_at_least(launch.backend_version, (0, 9, 0, 1))
            and find_flag(given, "enable-prompt-tokens-details",
                          "no-enable-prompt-tokens-details") is None):
        injected.append("--enable-prompt-tokens-details")  # usage's cached_tokens
    if launch.extended_kv_cache is not None and find_flag(given, "kv-transfer-config") is None:
        if launch.device == "gpu" and (launch.gpu_vendor or "").lower() in LMCACHE_VENDORS:
            injected += ["--kv-transfer-config", LMCACHE_CONNECTOR]
        else:
            warnings.append("the extended KV cache (LMCache) runs on NVIDIA and AMD GPUs only: "
                            "serving without it")
    names = ["--host", launch.main.host, "--port", str(launch.port),
             "--served-model-name", *launch.served_names]
    argv = [launch.python, *VLLM_SERVER, "--model", launch.model_path, *injected, *given,
            *names]
    return Command(argv=argv, env=vllm_env(launch, warnings), injected=injected + names,
                   warnings=warnings)


def ray_node(launch: VllmLaunch, stage: Stage, ray: str, port_start: int | None = None,
             num_cpus: int | None = None) -> Command:
    """`ray start` for one worker of a multi-worker placement: the head on the main worker
    (vLLM's executor joins it), a follower on each subordinate, joined to the head's GCS."""
    head = stage == launch.main
    gpus = stage.gpu_indexes if launch.device == "gpu" else ()
    return ray_start(ray, stage.host, launch.ray_port if port_start is None else port_start,
                     head=None if head else f"{launch.main.host}:{launch.ray_port}",
                     num_cpus=num_cpus, gpu_indexes=gpus, env=launch.env)


def ray_start(ray: str, host: str, port_start: int, head: str | None = None,
              num_cpus: int | None = None, gpu_indexes: tuple[int, ...] = (),
              env: dict[str, str] | None = None) -> Command:
    """One Ray node in the foreground (`--block`: it ends when its node does), its ports the
    RAY_PORTS from `port_start` and a worker range above them (the seed's layout, so two nodes
    of one host never share a port); `head` None starts the head (GCS at `port_start`), else a
    follower joined to that GCS address. `num_cpus` is the ranks the node takes: on CPU, Ray
    would otherwise count every core of the host for each node."""
    argv = [ray, "start", "--block", "--disable-usage-stats",
            f"--node-manager-port={port_start + 7}", f"--object-manager-port={port_start + 8}",
            f"--runtime-env-agent-port={port_start + 9}",
            f"--dashboard-agent-grpc-port={port_start + 4}",
            f"--dashboard-agent-listen-port={port_start + 5}",
            f"--metrics-export-port={port_start + 6}",
            f"--min-worker-port={port_start + RAY_PORTS - 2}",
            f"--max-worker-port={port_start + RAY_PORTS - 2 + RAY_WORKER_PORTS}",
            f"--node-ip-address={host}"]
    if num_cpus is not None:
        argv.append(f"--num-cpus={num_cpus}")
    if head is None:
        argv += ["--head", f"--port={port_start}", "--include-dashboard=false"]
    else:
        argv.append(f"--address={head}")
    node_env = {"RAY_LOG_TO_STDERR": "1", "RAY_BACKEND_LOG_LEVEL": "warning",
                **RAY_JOIN_ENV, **(env or {})}
    if gpu_indexes:
        node_env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpu_indexes))
    return Command(argv=argv, env=node_env)


def build_custom(command: str, parameters: list[str], values: dict[str, str],
                 env: dict[str, str]) -> Command:
    """A custom backend: its command with the placeholders filled in (each value one argument,
    whatever it holds), then the model's backend_parameters."""
    argv: list[str] = []
    for token in shlex.split(command):
        for name in PLACEHOLDERS:
            token = token.replace("{" + name + "}", values.get(name, ""))
        argv.append(token)
    return Command(argv=argv + flatten_parameters(parameters), env=dict(env))
