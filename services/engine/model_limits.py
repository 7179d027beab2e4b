"""What a model's configuration lets an engine do: the tensor / pipeline sizes that split it and
the longest context it takes, by vLLM's rules. Torch-free, and the one owner of both rules: the
engine checks them before a rank starts, the scheduler before it places an instance, and a deploy
(the scheduler's dry run) refuses what breaks them with a 400 naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from shoal.services.engine.config import ENGINE_DEFAULTS, ConfigError

SCALED_ROPE_TYPES = ("linear", "dynamic", "yarn")
"""Rope variants whose `factor` stretches the context beyond max_position_embeddings (vLLM's
rule: every type but default, su, longrope and llama3, whose max_position_embeddings already
counts the scaling)."""


# ---------------------------------------------------------------- parallel sizes
MLP_SIZE_KEYS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
"""The config fields of the MLP widths tensor parallelism splits: the dense MLP, each expert of
an MoE (Qwen-MoE; Mixtral's experts are `intermediate_size` wide) and a shared expert."""


def mlp_split_size(sizes: Iterable[int | None]) -> int:
    """The one width tp must divide for all of a model's MLPs: their gcd (tp divides each of
    them exactly when it divides the gcd); 0 when none is given."""
    return math.gcd(*(int(s) for s in sizes if s))


def tp_problems(num_heads: int, num_kv_heads: int, intermediate_size: int, tp: int) -> list[str]:
    """What `tp` fails to divide, in words; empty when it splits the model. TP divides the
    attention heads and the MLP size, and divides the KV heads or is a multiple of them (each KV
    head is then replicated on tp / kv ranks)."""
    problems = []
    if num_heads % tp:
        problems.append(f"its {num_heads} attention heads")
    if (num_kv_heads % tp) if tp <= num_kv_heads else (tp % num_kv_heads):
        problems.append(f"its {num_kv_heads} KV heads (tp must divide them, or be a multiple of "
                        "them to replicate them)")
    if intermediate_size and intermediate_size % tp:  # (an MoE: mlp_split_size's gcd)
        problems.append(f"its MLP size {intermediate_size}")
    return problems


def tp_divides_kv_heads(num_kv_heads: int, tp: int) -> bool:
    """Whether each rank holds whole KV heads of its own (no KV head replicated across ranks):
    what a norm over the whole K projection (OLMoE) needs."""
    return num_kv_heads % tp == 0


def valid_tp_sizes(num_heads: int, num_kv_heads: int, intermediate_size: int) -> list[int]:
    """Every tensor-parallel size that splits the model (1 included)."""
    return [t for t in range(1, num_heads + 1)
            if not tp_problems(num_heads, num_kv_heads, intermediate_size, t)]


def check_parallel_sizes(name: str, num_heads: int, num_kv_heads: int, intermediate_size: int,
                         num_layers: int, tp: int, pp: int) -> None:
    """ConfigError naming what tp fails to divide (with the sizes that work) or that pp exceeds
    the layers; `param` is the engine's name of the size."""
    if tp < 1 or pp < 1:
        raise ConfigError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                          f"{tp} and {pp}", param="tensor_parallel_size")
    problems = tp_problems(num_heads, num_kv_heads, intermediate_size, tp)
    if problems:
        sizes = valid_tp_sizes(num_heads, num_kv_heads, intermediate_size)
        raise ConfigError(f"tensor_parallel_size={tp} cannot split {name}: it does not "
                          f"divide {' nor '.join(problems)}; sizes that work: "
                          f"{', '.join(map(str, sizes))}", param="tensor_parallel_size")
    if pp > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp} exceeds the {num_layers} layers of {name}",
                          param="pipeline_parallel_size")


# ---------------------------------------------------------------- context length
@dataclass(frozen=True, slots=True)
class ContextLimit:
    """The longest context a model takes (vLLM's derived max_model_len) and where it comes from,
    for the message that refuses a longer one."""

    max_model_len: int
    derivation: str
    """e.g. "max_position_embeddings=4096 x rope factor 2.0 (linear) in the model's config"."""


def rope_scaling(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The rope variant's parameters: rope_parameters (transformers >= 5) or rope_scaling."""
    for key in ("rope_parameters", "rope_scaling"):
        value = config.get(key)
        if isinstance(value, Mapping) and ("rope_type" in value or "type" in value):
            return value
    return {}


def context_limit(config: Mapping[str, Any]) -> ContextLimit:
    """The derived max_model_len of a transformers config (as a dict): max_position_embeddings
    (the engine's fallback when absent), times the rope factor for the variants that stretch it
    (yarn from original_max_position_embeddings), as vLLM derives it."""
    raw = config.get("max_position_embeddings")
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 1:
        fallback = ENGINE_DEFAULTS.max_model_len_fallback
        return ContextLimit(fallback, f"the engine's default {fallback}: the model's config has "
                                      "no max_position_embeddings")
    rope = rope_scaling(config)
    kind = str(rope.get("rope_type") or rope.get("type") or "default")
    factor = rope.get("factor")
    if (kind not in SCALED_ROPE_TYPES or not isinstance(factor, (int, float))
            or isinstance(factor, bool) or factor <= 0 or factor == 1):
        return ContextLimit(raw, f"max_position_embeddings={raw} in the model's config")
    base, key = raw, "max_position_embeddings"
    original = rope.get("original_max_position_embeddings")
    if kind == "yarn" and isinstance(original, int) and original > 0:
        base, key = original, "original_max_position_embeddings"
    return ContextLimit(int(base * factor), f"{key}={base} x rope factor {factor:g} ({kind}) in "
                                            "the model's config")


def resolve_max_model_len(requested: int | None, limit: ContextLimit) -> int:
    """The context an engine runs: the user's, or the model's whole length. Longer than the
    model's is refused, as vLLM refuses it (positions past it were never trained)."""
    if requested is None:
        return limit.max_model_len
    if requested > limit.max_model_len:
        raise ConfigError(f"User-specified max_model_len ({requested}) is greater than the "
                          f"derived max_model_len ({limit.derivation}): the model cannot attend "
                          f"beyond {limit.max_model_len} tokens; set max_model_len to "
                          f"{limit.max_model_len} or less", param="max_model_len")
    return requested
