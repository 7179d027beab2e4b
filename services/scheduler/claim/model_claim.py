"""ModelClaim: weights + KV cache of one full-length sequence + activations, per device kind.

The engine's own rules and defaults (ENGINE_DEFAULTS) decide the bytes: 'auto' dtype is bfloat16
on GPU and float32 on CPU, so a GGUF model claims its dequantised size, not its file size; an
unset KV pool on CPU is the engine's default pool; unset batch limits are the engine's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from shoal.services.engine import DTYPE_BYTES, ENGINE_DEFAULTS, tp_problems
from shoal.services.scheduler.claim.profile import ModelProfile, ModelShape
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.registry import DeviceKind, ModelSpec
from shoal.shared.units import MIB, fmt_bytes, fmt_params

GPU_RUNTIME_OVERHEAD = 512 * MIB
"""CUDA context, cuBLAS workspace and graph pool of one engine process, per GPU."""
CPU_RUNTIME_OVERHEAD = 256 * MIB
"""Python, torch and tokenizer of one engine process."""


@dataclass(frozen=True, slots=True)
class ModelClaim:
    """What one instance of a model needs on one device kind, with its parts (bytes)."""

    device: str
    """'gpu' or 'cpu'."""
    dtype: str
    max_model_len: int
    num_params: int
    weights: int
    kv_cache: int
    """At least one sequence of max_model_len tokens."""
    activations: int
    """Per process (so per GPU): batch activations, logits and runtime overhead."""
    shape: ModelShape
    gpu_memory_utilization: float = 0.9

    @property
    def total(self) -> int:
        return self.weights + self.kv_cache + self.activations

    @property
    def claims_gpu_fraction(self) -> bool:
        """An LLM instance takes gpu_memory_utilization of each GPU it uses, as vLLM does."""
        return self.device == "gpu" and self.shape.is_causal_lm

    def per_gpu(self, num_gpus: int) -> int:
        """Bytes each of `num_gpus` GPUs must hold: weights and KV split evenly (TP x PP)."""
        return math.ceil((self.weights + self.kv_cache) / num_gpus) + self.activations

    def valid_tp(self, tp: int) -> bool:
        """The engine's rule (vLLM's; services/engine/model_limits.py owns it): TP divides the
        attention heads and the MLP size, and divides the KV heads or is a multiple of them."""
        s = self.shape
        return not tp_problems(s.num_attention_heads, s.num_kv_heads, s.mlp_split_size, tp)

    def kv_bytes_per_token(self) -> int:
        s = self.shape
        return s.num_layers * 2 * s.num_kv_heads * s.head_dim * DTYPE_BYTES[self.dtype]

    def describe(self) -> str:
        """One sentence with the parts, for users ('shoal models deploy --dry-run')."""
        s = self.shape
        where = "GPU memory" if self.device == "gpu" else "RAM"
        one_seq = self.kv_bytes_per_token() * self.max_model_len
        seq = (f"one {self.max_model_len}-token sequence: {s.num_layers} layers x 2 x "
               f"{s.num_kv_heads} KV heads x {s.head_dim} x {DTYPE_BYTES[self.dtype]} bytes")
        if not self.kv_cache:
            kv = "no KV cache (encoder)"
        elif self.kv_cache > one_seq:
            kv = (f"KV cache {fmt_bytes(self.kv_cache)} (the engine's pool; "
                  f"{seq} = {fmt_bytes(one_seq)})")
        else:
            kv = f"KV cache {fmt_bytes(self.kv_cache)} ({seq})"
        return (f"The model needs {fmt_bytes(self.total)} of {where}: weights "
                f"{fmt_bytes(self.weights)} ({fmt_params(self.num_params)} parameters in "
                f"{self.dtype}) + {kv} + activations {fmt_bytes(self.activations)}.")


def resolve_dtype(spec_dtype: str, device: str) -> str:
    """The dtype an engine on `device` ('gpu' or 'cpu') runs in (the engine's rule)."""
    try:
        return ENGINE_DEFAULTS.dtype(spec_dtype or "auto", device)
    except InvalidRequest as exc:
        raise InvalidRequest(exc.message, param="dtype") from None


def compute_claim(profile: ModelProfile, spec: ModelSpec, device: str) -> ModelClaim:
    """The claim of one instance of `profile` deployed with `spec` on 'gpu' or 'cpu'."""
    if device not in ("gpu", "cpu"):
        raise ValueError(f"device must be 'gpu' or 'cpu', got {device!r}")
    shape = profile.shape
    dtype = resolve_dtype(spec.dtype, device)
    dtype_bytes = DTYPE_BYTES[dtype]
    max_model_len = spec.max_model_len or shape.context_limit.max_model_len
    weights = profile.num_params * dtype_bytes
    kv_cache = 0
    if shape.is_causal_lm:
        kv_cache = (shape.num_layers * 2 * shape.num_kv_heads * shape.head_dim * max_model_len
                    * dtype_bytes)
        pool = spec.engine_args.kv_cache_memory
        if pool is None:
            pool = ENGINE_DEFAULTS.cpu_kv_cache_memory if device == "cpu" else 0
        kv_cache = max(kv_cache, pool)
    args = spec.engine_args
    tokens = args.max_num_batched_tokens or ENGINE_DEFAULTS.max_num_batched_tokens
    seqs = args.max_num_seqs or ENGINE_DEFAULTS.max_num_seqs
    width = (4 * shape.hidden_size + 2 * shape.intermediate_size
             + (shape.num_attention_heads + 2 * shape.num_kv_heads) * shape.head_dim)
    activations = tokens * width * dtype_bytes + seqs * shape.vocab_size * 4
    activations += GPU_RUNTIME_OVERHEAD if device == "gpu" else CPU_RUNTIME_OVERHEAD
    return ModelClaim(device=device, dtype=dtype, max_model_len=max_model_len,
                      num_params=profile.num_params, weights=weights, kv_cache=kv_cache,
                      activations=activations, shape=shape,
                      gpu_memory_utilization=spec.gpu_memory_utilization)


def device_kinds(spec: ModelSpec) -> tuple[str, ...]:
    """Which claims a model needs: its device, or both for 'auto'."""
    if spec.device is DeviceKind.GPU:
        return ("gpu",)
    if spec.device is DeviceKind.CPU:
        return ("cpu",)
    return ("gpu", "cpu")
