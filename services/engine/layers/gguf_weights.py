"""A GGUF file's own Q4_1 weights as the engine's int4 layers (`quantization="gguf"`).

Q4_1 stores each row in blocks of 32 weights: an fp16 step d, an fp16 minimum m and 32 4-bit
codes q, w = d * q + m. torch's int4 CPU layout is group-wise affine over groups of 32 along the
input (w = scale * (q - 8) + zero), so a block maps onto a group with the same codes, scale = d
and zero = m + 8 d: the codes are the file's, only the scales and zeros are rounded (to bf16, the
kernel's dtype). The file's q/k rows are in llama.cpp's rotary order; transformers' own GGUF
processor, applied to row numbers, says where each row goes, and every layer is checked against
the weights the engine loaded from the converted folder before it replaces them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from torch import nn

from shoal.services.engine.config import ConfigError
from shoal.services.engine.layers.cpu_weights import INT4_GROUP, Int4Linear

Q4_1_BLOCK_BYTES = 20
"""fp16 d, fp16 m, 16 bytes of codes (ggml's block_q4_1)."""


def q4_1_blocks(raw: np.ndarray, rows: int, cols: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_1 tensor's bytes -> codes [rows, cols] uint8 in 0..15, d and m [rows, cols / 32] fp32.
    A block's low nibbles are its weights 0..15, its high nibbles weights 16..31."""
    blocks = np.ascontiguousarray(raw).reshape(rows, cols // INT4_GROUP, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    codes = np.concatenate([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, cols)
    return torch.from_numpy(codes), torch.from_numpy(d), torch.from_numpy(m)


class GGUFQ4Source:
    """The Q4_1 tensors of one GGUF file, by transformers' (Hugging Face) parameter name."""

    def __init__(self, path: Path) -> None:
        import gguf
        from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

        self.reader = gguf.GGUFReader(str(path))
        self.string_type = gguf.GGUFValueType.STRING
        arch = self._field("general.architecture")
        self.arch = arch
        archs = {name: key for key, name in gguf.MODEL_ARCH_NAMES.items()}
        if arch not in archs:
            raise ConfigError(f"GGUF architecture {arch!r} is unknown to the gguf package",
                              param="quantization")
        blocks = int(self._field(f"{arch}.block_count"))
        self.names = gguf.get_tensor_name_map(archs[arch], blocks)
        self.tensors = {t.name: t for t in self.reader.tensors}
        heads = self._field(f"{arch}.attention.head_count")
        kv_heads = self._field(f"{arch}.attention.head_count_kv", heads)
        self.processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(
            config={"num_attention_heads": heads, "num_key_value_heads": kv_heads})
        self.q4_1 = gguf.GGMLQuantizationType.Q4_1

    def _field(self, key: str, default: object = None) -> object:
        field = self.reader.fields.get(key)
        if field is None:
            if default is None:
                raise ConfigError(f"GGUF metadata lacks {key}", param="quantization")
            return default
        value = field.parts[field.data[0]]
        if field.types[0] == self.string_type:
            return bytes(value).decode()
        return value.item()

    def blocks(self, hf_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, d, m) of a Hugging Face weight name in Hugging Face row order; None when the
        file stores that tensor other than as Q4_1."""
        name = self.names.get_name(hf_name, try_suffixes=(".weight",))
        tensor = self.tensors.get(name) if name else None
        if tensor is None or tensor.tensor_type != self.q4_1:
            return None
        cols, rows = (int(n) for n in tensor.shape[:2])  # GGUF lists dims innermost first
        codes, d, m = q4_1_blocks(tensor.data, rows, cols)
        order = self.processor.process(np.arange(rows), name).weights  # q/k: rotary order
        order = torch.from_numpy(np.asarray(order, dtype=np.int64))
        return codes[order], d[order], m[order]


def gguf_int4_layers(model: nn.Module, path: Path,
                     cache: Path | None = None) -> dict[str, Int4Linear]:
    """Int4 layers for every Linear of `model` whose checkpoint tensors are Q4_1 in `path`
    (packed q/k/v and gate/up: their parts stacked by rows), keyed by module name. Each is
    checked against the module's loaded (dequantised) weight. `cache`: a safetensors file of
    the checked codes, d and m, read instead of the GGUF when present (parsing a GGUF's metadata,
    its vocabulary included, takes seconds) and written after the first extraction."""
    if cache is not None and cache.is_file():
        return _from_cache(model, cache)
    blocks = _checked_blocks(model, path)
    if cache is not None:
        _write_cache(blocks, cache)
    return {name: Int4Linear.from_codes(codes, d, m, _linear(model, name).bias)
            for name, (codes, d, m) in blocks.items()}


def _linear(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def _checked_blocks(model: nn.Module, path: Path
                    ) -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    from shoal.services.engine.layers.linear import Linear

    source = GGUFQ4Source(path)
    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    parts_of: dict[str, list[str]] = {}
    for hf_part, (our_part, _shard) in mapping.items():
        parts_of.setdefault(our_part, []).append(hf_part)
    blocks = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        prefix, _, last = name.rpartition(".")
        hf_names = [f"{prefix}.{part}.weight" for part in parts_of.get(last, [last])]
        found = [source.blocks(hf) for hf in hf_names]
        if any(f is None for f in found):
            continue
        codes, d, m = (torch.cat(parts) for parts in zip(*found, strict=True))
        dense = (d.repeat_interleave(INT4_GROUP, 1) * codes.float()
                 + m.repeat_interleave(INT4_GROUP, 1))
        if dense.shape != module.weight.shape or not torch.allclose(
                dense, module.weight.float(), rtol=1e-5, atol=1e-6):
            raise ConfigError(f"the GGUF's Q4_1 blocks of {name} do not match the weights "
                              "converted from it (tensor parallel? another file?)",
                              param="quantization")
        blocks[name] = (codes, d, m)
    return blocks


def _write_cache(blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
                 cache: Path) -> None:
    """Two codes a byte; written to a temporary name and renamed (a crash leaves no half file)."""
    from safetensors.torch import save_file

    tensors = {}
    for name, (codes, d, m) in blocks.items():
        tensors[f"{name}.codes"] = (codes[:, 0::2] | (codes[:, 1::2] << 4)).contiguous()
        tensors[f"{name}.d"], tensors[f"{name}.m"] = d.contiguous(), m.contiguous()
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, cache)
    except OSError:  # a read-only cache folder: extract again next time
        tmp.unlink(missing_ok=True)


def _from_cache(model: nn.Module, cache: Path) -> dict[str, Int4Linear]:
    from safetensors import safe_open

    layers = {}
    with safe_open(str(cache), framework="pt") as f:
        names = {key.rsplit(".", 1)[0] for key in f.keys()}
        for name in sorted(names):
            packed = f.get_tensor(f"{name}.codes")
            codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).view(packed.shape[0], -1)
            layers[name] = Int4Linear.from_codes(codes, f.get_tensor(f"{name}.d"),
                                                 f.get_tensor(f"{name}.m"),
                                                 _linear(model, name).bias)
    return layers
