"""The Hugging Face config of a GGUF file: transformers' reading of its metadata, plus the keys
llama.cpp writes for mixture-of-experts models that transformers does not map.

llama.cpp's converter writes a Qwen-MoE's expert width as `<arch>.expert_feed_forward_length`
(and the shared expert's as `expert_shared_feed_forward_length`); transformers' GGUF config
mapping omits them, so its config keeps the class defaults (768, 5632) and the stacked expert
tensors fail to load. llama.cpp also runs experts in every layer of these architectures (no
`mlp_only_layers`, `decoder_sparse_step` 1) and renormalises the top-k weights for qwen3moe, not
for qwen2moe: the config says so explicitly rather than relying on the class defaults.
Gemma 2: its soft-caps (`attn_logit_softcapping`, `final_logit_softcapping`) are written but not
mapped, and llama.cpp has no key for `query_pre_attn_scalar`: it scales queries by the head
size (hidden / heads for the 27B), which the config gets here instead of the class default.
Gemma 3: the same query scale, and the global layers' linear RoPE scaling (`rope.scaling.type`
/ `rope.scaling.factor`, Gemma 3 4B-27B's factor 8); its 5:1 sliding / full pattern and the
local layers' base 10000 are transformers' defaults, as llama.cpp hard-codes them.
Phi-3: partial rotary (`rope.dimension_count`) and LongRoPE (its factors are tensors), both
dropped by transformers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.services.engine.config import ConfigError

EXTRA_KEYS: dict[str, dict[str, str]] = {
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "gemma2": {"attn_logit_softcapping": "attn_logit_softcapping",
               "final_logit_softcapping": "final_logit_softcapping"},
    "gemma3": {},
    "phi3": {},
}
"""llama.cpp architecture -> {its metadata key (after `<arch>.`): our config attribute}."""

FIXED: dict[str, dict[str, Any]] = {
    "qwen3moe": {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True},
    "qwen2moe": {"mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": False},
}
"""What llama.cpp's graph for the architecture does, as config values."""


_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
            11: "<q", 12: "<d"}
"""GGUF value types -> struct formats (8: string, 9: array)."""


def gguf_metadata(path: Path) -> dict[str, Any]:
    """The file's scalar metadata (keys as written, `qwen3moe.expert_count`...), arrays skipped.
    Read directly (GGUF v2/v3, little-endian): gguf's GGUFReader builds every array too, the
    vocabulary's included, which takes seconds."""
    import mmap
    import struct

    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        magic, version, _tensors, count = struct.unpack_from("<4sIQQ", buf, 0)
        if magic != b"GGUF" or version < 2:
            raise ConfigError(f"{path} is not a GGUF v2/v3 file")
        pos = 24

        def read(fmt: str) -> Any:
            nonlocal pos
            (value,) = struct.unpack_from(fmt, buf, pos)
            pos += struct.calcsize(fmt)
            return value

        def string() -> str:
            nonlocal pos
            n = read("<Q")
            pos += n
            return bytes(buf[pos - n:pos]).decode("utf-8", "replace")

        def value(kind: int) -> Any:
            nonlocal pos
            if kind == 8:
                return string()
            if kind == 9:  # skipped: its items' type, count, items
                item, n = read("<I"), read("<Q")
                if item in _SCALARS:
                    pos += n * struct.calcsize(_SCALARS[item])
                else:
                    for _ in range(n):
                        value(item)
                return None
            return read(_SCALARS[kind])

        out: dict[str, Any] = {}
        for _ in range(count):
            key = string()
            if (v := value(read("<I"))) is not None:
                out[key] = v
        return out


def gguf_config(path: Path) -> Any:
    """transformers' config of the GGUF file at `path`, completed for the architectures above;
    None for the others (transformers' own reading is right for them)."""
    from transformers import AutoConfig

    meta = gguf_metadata(path)
    arch = str(meta.get("general.architecture", ""))
    if arch == "llama" and meta.get("llama.expert_count"):
        raise ConfigError("a GGUF of architecture 'llama' with experts (Mixtral as llama.cpp "
                          "writes it) is not supported: transformers cannot convert it; serve "
                          "the Hugging Face folder instead")
    if arch not in EXTRA_KEYS and arch not in FIXED:
        return None
    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    for key, attr in EXTRA_KEYS.get(arch, {}).items():
        if f"{arch}.{key}" in meta:
            setattr(config, attr, meta[f"{arch}.{key}"])  # (uint32 -> int, float32 -> float)
    for attr, value in FIXED.get(arch, {}).items():
        setattr(config, attr, value)
    if arch in ("gemma2", "gemma3"):  # llama.cpp's query scale: hidden / heads for the 27Bs
        heads = int(meta[f"{arch}.attention.head_count"])
        big = meta.get(f"{arch}.block_count") == {"gemma2": 46, "gemma3": 62}[arch]
        config.query_pre_attn_scalar = (
            int(meta[f"{arch}.embedding_length"]) // heads if big
            else int(meta.get(f"{arch}.attention.key_length", config.head_dim)))
    if arch == "gemma3" and meta.get("gemma3.rope.scaling.type") == "linear":  # global layers
        full = config.rope_parameters["full_attention"]
        config.rope_parameters["full_attention"] = {
            **full, "rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
    if arch == "phi3":
        _phi3_rope(config, meta, path)
    return config


def _phi3_rope(config: Any, meta: dict[str, Any], path: Path) -> None:
    """Phi-3's partial rotary (`rope.dimension_count` < the head size: Phi-4-mini) and LongRoPE,
    whose factors llama.cpp writes as the tensors `rope_factors_long` / `rope_factors_short`."""
    import gguf

    head_dim = int(meta["phi3.embedding_length"]) // int(meta["phi3.attention.head_count"])
    partial = int(meta.get("phi3.rope.dimension_count", head_dim)) / head_dim
    rope: dict[str, Any] = {"rope_type": "default", "partial_rotary_factor": partial,
                            "rope_theta": float(meta.get("phi3.rope.freq_base", 10000.0))}
    factors = {t.name: t.data.tolist() for t in gguf.GGUFReader(str(path)).tensors
               if t.name in ("rope_factors_long.weight", "rope_factors_short.weight")}
    if len(factors) == 2:
        original = int(meta["phi3.rope.scaling.original_context_length"])
        rope |= {"rope_type": "longrope", "long_factor": factors["rope_factors_long.weight"],
                 "short_factor": factors["rope_factors_short.weight"],
                 "original_max_position_embeddings": original}
        config.original_max_position_embeddings = original
    config.partial_rotary_factor = partial
    config.rope_parameters = rope
