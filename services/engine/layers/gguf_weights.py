"""A GGUF file's own quantised blocks as the engine's layers (`quantization="gguf"`, the default
for a .gguf model on one CPU rank).

- Q8_0, Q4_0, Q5_0, Q5_1 and the K-quants Q4_K, Q5_K, Q6_K (what Q8_0 / Q4_K_M / Q5_K_M / Q6_K
  files hold) stay as the file's bytes, one row of blocks per output row, and run the C++ ops of
  kernels/csrc/cpu_gguf.cpp (`GGUFBlockLinear`): where AVX-512 VNNI is built, Q4_K / Q6_K /
  Q8_0 (and Q4_1, below) are repacked at load into 16 interleaved rows and, below
  `cpu_ops.Q8_MAX_ROWS` tokens a step, meet the step's rows quantised to int8 (per 256, or per
  32 where K is no multiple of 256) in integer dot products (`gguf_matmul_packed`, llama.cpp's
  way); the other types (or a K the packing does not take) quantise per 32 (`gguf_matmul_q8`;
  Q8_0 below `MANY_ROWS` then keeps the exact float path, as fast there); without VNNI, below
  `MANY_ROWS` a matmul that unpacks each block to floats in L1 as it streams past
  (`gguf_matmul`, exact: the tests' reference). Either reads the weight at its stored size.
  From there a copy of the weight unpacked once (bf16, packed for oneDNN: `ManyRows`) runs the
  GEMM as the bf16 model's prefill does, where those copies take under an eighth of memory;
  else each weight is unpacked for the step into bf16 (fp32 without a bf16 GEMM) first.
- Q4_1 stores each row in blocks of 32 weights: an fp16 step d, an fp16 minimum m and 32 4-bit
  codes q, w = d * q + m. Where the packed kernels are built (AVX-512 VNNI) it is repacked at
  load as Q4_K / Q6_K / Q8_0 are (16 rows interleaved, activations int8 per 32: K need only be
  a multiple of 32, SmolLM2's 576) and runs as a `GGUFBlockLinear`. Elsewhere it runs as
  `Int4Linear`: torch's int4 CPU layout is group-wise affine over groups of 32 along the input
  (w = scale * (q - 8) + zero), so a block maps onto a group with the same codes, scale = d and
  zero = m + 8 d: the codes are the file's, only the scales and zeros are rounded (to bf16, the
  kernel's dtype).
The file's q/k rows are in llama.cpp's rotary order; transformers' own GGUF processor, applied to
row numbers, says where each row goes, and every layer is checked against the weights the engine
loaded from the converted folder before it replaces them. A packed layer (q/k/v, gate/up) whose
parts are stored in different types (Q4_K_M keeps v in Q6_K) runs one matmul per part.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import cpu_ops
from shoal.services.engine.config import ConfigError
from shoal.services.engine.layers.cpu_weights import (
    INT4_GROUP,
    MANY_ROWS,
    Int4Linear,
    ManyRows,
    bf16_gemm_available,
)

Q4_1_BLOCK_BYTES = 20
"""fp16 d, fp16 m, 16 bytes of codes (ggml's block_q4_1)."""
Q4_1 = 3
Q8_0 = 8
FLOAT_FEW_ROWS = {Q8_0}
"""Types whose steps of fewer than MANY_ROWS rows keep the float block matmul where the int8 one
is built (see GGUFBlockLinear._few_rows)."""
BLOCK_TYPES = {2: "Q4_0", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
"""ggml type ids the C++ ops run as stored (kernels/csrc/cpu_gguf.cpp), by name."""
TYPE_NAMES = BLOCK_TYPES | {Q4_1: "Q4_1"}
"""Every type a GGUFBlockLinear holds (Q4_1 where it is packed), by name."""
FLOAT_TYPES = {0: "F32", 1: "F16", 30: "BF16"}
"""Unquantised tensors: their layers run the dense fp32 kernels."""


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


def dequantize(blocks: torch.Tensor, ggml_type: int, cols: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[N, row bytes] uint8 blocks of a BLOCK_TYPES type -> [N, cols] weights (C++ op)."""
    return torch.ops.shoal_cpu.gguf_dequantize(blocks, ggml_type, cols, dtype)


KEPT_FROM_ROWS = 4
"""With a kept bf16 copy (keep_many_rows), steps from this many rows run its GEMM: one thread,
4096 x 2048, it took 0.68 ms at 4 rows and 0.80 at 8 against the int8 block kernel's 0.88-1.18
and 1.21-1.54 (Q4_K..Q6_K); at one row the block kernel's 0.36 against 0.59."""

_scratch = threading.local()


def _unpacked(blocks: torch.Tensor, ggml_type: int, cols: int, dtype: torch.dtype
              ) -> torch.Tensor:
    """The weight unpacked for one step into this thread's buffer of its shape (reused: a fresh
    tensor of tens of MB pays its page faults every step: a 512-token step at 8192 x 2048 ran at
    0.67x of bf16's time, 0.92x with the buffer; the GEMM is done with it before the next layer's
    unpacking)."""
    buffers: dict[tuple[int, int, torch.dtype], torch.Tensor] = _scratch.__dict__.setdefault(
        "buffers", {})
    key = (blocks.shape[0], cols, dtype)
    if key not in buffers:
        buffers[key] = torch.empty(blocks.shape[0], cols, dtype=dtype)
    torch.ops.shoal_cpu.gguf_dequantize_into(blocks, ggml_type, buffers[key])
    return buffers[key]


class GGUFBlockLinear:
    """y = x W^T + b with W kept as a GGUF file's blocks: `parts` [(ggml type, blocks [N_i, row
    bytes])] stacked by output rows (a packed layer's q/k/v may differ in type)."""

    def __init__(self, parts: list[tuple[int, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None) -> None:
        merged: list[tuple[int, torch.Tensor]] = []
        for ggml_type, blocks in parts:  # neighbours of one type: one matmul
            if merged and merged[-1][0] == ggml_type:
                merged[-1] = (ggml_type, torch.cat([merged[-1][1], blocks]))
            else:
                merged.append((ggml_type, blocks.contiguous()))
        self.rows = [b.shape[0] for _, b in merged]
        self.packed = [cpu_ops.packed_available(t, in_features) for t, _ in merged]
        # one part at a time, so the stored and the packed copies coexist for one part only
        self.parts = [(t, torch.ops.shoal_cpu.gguf_repack(b, t) if packed else b)
                      for (t, b), packed in zip(merged, self.packed, strict=True)]
        del merged
        self.in_features = in_features
        self.bias = None if bias is None else bias.detach()
        self.gemm_dtype = torch.bfloat16 if bf16_gemm_available() else torch.float32
        self.q8 = cpu_ops.q8_available(in_features)
        self.many: ManyRows | None = None  # (keep_many_rows)
        self.packed_below = cpu_ops.Q8_MAX_ROWS if self.q8 else MANY_ROWS
        """Steps of fewer rows run `gguf_matmul_packed` on a packed part (`_few_rows`)."""
        self.packed_op = cpu_ops.op("gguf_matmul_packed") if all(self.packed) else None
        """Every part packed: their matmuls called straight from __call__ at few rows (a decode
        step makes 121 such calls on SmolLM2: the routing below and `torch.ops`' Python layers
        cost ~3 us of a ~9 us call; Q4_K_M's q/k/v with v in Q6_K are two parts)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.packed_op is not None and rows < self.packed_below and (
                x.dtype == torch.float32):  # `_few_rows`' packed path, without the routing
            outs = [self.packed_op(x, blocks, ggml_type, n)
                    for (ggml_type, blocks), n in zip(self.parts, self.rows, strict=True)]
            out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)
            return out if self.bias is None else out + self.bias
        if self.many is not None and rows >= KEPT_FROM_ROWS:
            outs = [self.many(x)]
        elif rows < MANY_ROWS or (self.q8 and rows < cpu_ops.Q8_MAX_ROWS):
            xf = x.float().contiguous()
            outs = [self._few_rows(xf, i) for i in range(len(self.parts))]
        else:
            xg = x.to(self.gemm_dtype)
            outs = [F.linear(xg, _unpacked(self._blocks(i), t, self.in_features,
                                           self.gemm_dtype))
                    for i, (t, _) in enumerate(self.parts)]
        out = (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def _blocks(self, i: int) -> torch.Tensor:
        """Part i as the file stores it (unpacked from the packed layout for the paths that
        dequantise: exact, a copy of the part's size)."""
        ggml_type, tensor = self.parts[i]
        if self.packed[i]:
            return torch.ops.shoal_cpu.gguf_unrepack(tensor, ggml_type, self.rows[i])
        return tensor

    def _few_rows(self, xf: torch.Tensor, i: int) -> torch.Tensor:
        """int8 activations where built, but Q8_0 below MANY_ROWS: its float unpacking (8-bit
        codes straight to floats) was as fast as the int8 path at one and two rows, and exact
        (benchmarks/gguf_kernels.py). Q4_K / Q6_K up to Q8K_MAX_ROWS rows: activations per 256
        (`gguf_matmul_q8k`); the packed layouts (Q4_K, Q6_K, Q8_0: 16 rows interleaved,
        activations per 256) below Q8_MAX_ROWS, Q8_0 included (2x its float path)."""
        ggml_type, blocks = self.parts[i]
        if self.packed[i]:
            return torch.ops.shoal_cpu.gguf_matmul_packed(xf, blocks, ggml_type, self.rows[i])
        if xf.shape[0] <= cpu_ops.Q8K_MAX_ROWS and cpu_ops.q8k_available(ggml_type):
            return torch.ops.shoal_cpu.gguf_matmul_q8k(xf, blocks, ggml_type)
        if self.q8 and (ggml_type not in FLOAT_FEW_ROWS or xf.shape[0] >= MANY_ROWS):
            return torch.ops.shoal_cpu.gguf_matmul_q8(xf, blocks, ggml_type)
        return torch.ops.shoal_cpu.gguf_matmul(xf, blocks, ggml_type)

    def dequantized(self) -> torch.Tensor:
        return torch.cat([dequantize(self._blocks(i), t, self.in_features)
                          for i, (t, _) in enumerate(self.parts)])

    def dense_numel(self) -> int:
        return sum(self.rows) * self.in_features

    def keep_many_rows(self) -> None:
        """Keep the weight unpacked once for the many-rows GEMM (layers/cpu_weights.py,
        `keep_many_rows_copies`): prefill then runs at the bf16 model's speed."""
        self.many = ManyRows(self.dequantized())
        self.packed_below = min(self.packed_below, KEPT_FROM_ROWS)


class GGUFSource:
    """The tensors of one GGUF file, by transformers' (Hugging Face) parameter name."""

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

    def tensor_type(self, hf_name: str) -> int | None:
        """The ggml type id a Hugging Face weight is stored in; None when the file lacks it."""
        name = self.names.get_name(hf_name, try_suffixes=(".weight",))
        tensor = self.tensors.get(name) if name else None
        return None if tensor is None else int(tensor.tensor_type)

    def raw(self, hf_name: str) -> tuple[int, np.ndarray] | None:
        """(ggml type, bytes [rows, row bytes]) of a quantised Hugging Face weight in Hugging Face
        row order; None when the file lacks it or stores it unquantised."""
        name = self.names.get_name(hf_name, try_suffixes=(".weight",))
        tensor = self.tensors.get(name) if name else None
        if tensor is None or int(tensor.tensor_type) in FLOAT_TYPES:
            return None
        rows = int(tensor.shape[1])  # GGUF lists dims innermost first
        raw = np.asarray(tensor.data).reshape(rows, -1)
        order = np.asarray(self.processor.process(np.arange(rows), name).weights,
                           dtype=np.int64)  # q/k: rotary order
        return int(tensor.tensor_type), raw[order]

    def blocks(self, hf_name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(codes, d, m) of a Q4_1 Hugging Face weight in Hugging Face row order; None when the
        file stores that tensor other than as Q4_1."""
        found = self.raw(hf_name)
        if found is None or found[0] != Q4_1:
            return None
        raw = found[1]
        return q4_1_blocks(raw, raw.shape[0], raw.shape[1] // Q4_1_BLOCK_BYTES * INT4_GROUP)


Kernel = Int4Linear | GGUFBlockLinear
Parts = list[tuple[int, torch.Tensor]]
"""A layer's stored parts: (ggml type, bytes [rows, row bytes]) each, stacked by rows."""


def open_source(gguf: Path | GGUFSource) -> GGUFSource:
    """`gguf` parsed (a caller that needs the file twice parses it once and passes the source)."""
    return gguf if isinstance(gguf, GGUFSource) else GGUFSource(gguf)


def gguf_layers(model: nn.Module, path: Path | GGUFSource, cache: Path | None = None,
                check: bool = True) -> tuple[dict[str, Kernel], set[str]]:
    """The file's own blocks for every Linear of `model` (and the LM head) whose checkpoint
    tensors are stored in Q4_1 or a BLOCK_TYPES type (packed q/k/v and gate/up: their parts
    stacked by rows), keyed by module name, and the names of the Linears stored unquantised
    (F32/F16/BF16: they keep dense kernels). `check`: each layer is compared with the module's
    loaded (dequantised) weight (a complete folder; a blocks folder loaded none). `cache`: a
    safetensors file of the checked blocks, read instead of the GGUF when present (parsing a
    GGUF's metadata, its vocabulary included, takes seconds) and written after the first
    extraction."""
    if cache is not None and cache.is_file():
        parts, dense = _read_cache(cache)
    else:
        parts, dense = _checked_parts(model, path, check)
        if cache is not None:
            _write_cache(parts, dense, cache)
    # popped one layer at a time: a layer's stored blocks go once its kernel holds them (packed)
    return {name: _kernel(_module(model, name), parts.pop(name)) for name in list(parts)}, dense


def block_weight_names(model: nn.Module, path: Path | GGUFSource, cache: Path | None = None
                       ) -> frozenset[str]:
    """The Hugging Face weight names gguf_layers will run as blocks (their dense parameters
    need no loading). Give gguf_layers the same GGUFSource: a first start from a blocks folder
    then parses the file's metadata once."""
    names = _hf_names(model)
    if cache is not None and cache.is_file():
        modules = set(_read_cache(cache)[0])
    else:
        source = open_source(path)
        modules = {name for name, hf in names.items()
                   if _as_blocks([source.tensor_type(h) for h in hf])}
    return frozenset(hf for name in modules for hf in names[name])


def _as_blocks(types: list[int | None]) -> bool:
    """Whether a layer whose parts are stored as `types` runs as the file's blocks."""
    return all(t == Q4_1 for t in types) or all(t in BLOCK_TYPES for t in types)


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def _kernel(module: nn.Module, parts: Parts) -> Kernel:
    bias = getattr(module, "bias", None)
    cols = module.weight.shape[1]
    if parts[0][0] == Q4_1 and not cpu_ops.packed_available(Q4_1, cols):  # (then every part is)
        raw = torch.cat([b for _, b in parts]).numpy()
        codes, d, m = q4_1_blocks(raw, raw.shape[0],
                                  raw.shape[1] // Q4_1_BLOCK_BYTES * INT4_GROUP)
        return Int4Linear.from_codes(codes, d, m, bias)
    return GGUFBlockLinear(parts, cols, bias)


def _hf_names(model: nn.Module) -> dict[str, list[str]]:
    """Every Linear's (and the LM head's) Hugging Face weight names, by module name."""
    from shoal.services.engine.layers.embedding import LMHead
    from shoal.services.engine.layers.linear import Linear

    mapping: dict[str, tuple[str, str]] = getattr(model, "packed_modules_mapping", {})
    parts_of: dict[str, list[str]] = {}
    for hf_part, (our_part, _shard) in mapping.items():
        parts_of.setdefault(our_part, []).append(hf_part)
    names: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            prefix, _, last = name.rpartition(".")
            names[name] = [f"{prefix}.{part}.weight" for part in parts_of.get(last, [last])]
        elif isinstance(module, LMHead):  # tied: the file has the embedding table only
            tied = getattr(model, "tie_word_embeddings", False)
            names[name] = ["model.embed_tokens.weight" if tied else f"{name}.weight"]
    return names


def _checked_parts(model: nn.Module, path: Path | GGUFSource, check: bool = True
                   ) -> tuple[dict[str, Parts], set[str]]:
    source = open_source(path)
    layers: dict[str, Parts] = {}
    dense: set[str] = set()
    for name, hf_names in _hf_names(model).items():
        module = _module(model, name)
        types = [source.tensor_type(hf) for hf in hf_names]
        if all(t in FLOAT_TYPES for t in types):
            dense.add(name)
            continue
        if not _as_blocks(types):
            continue  # (other types, or Q4_1 packed with others: int8 from the weight)
        parts = []
        for hf in hf_names:
            ggml_type, raw = source.raw(hf)  # type: ignore[misc]
            parts.append((ggml_type, torch.from_numpy(np.ascontiguousarray(raw))))
        cols = module.weight.shape[1]
        found = (torch.cat([_dequantize_any(t, b, cols) for t, b in parts]) if check
                 else None)
        if found is not None and (found.shape != module.weight.shape or not torch.allclose(
                found, module.weight.float(), rtol=1e-5, atol=1e-6)):
            raise ConfigError(f"the GGUF's blocks of {name} do not match the weights "
                              "converted from it (tensor parallel? another file?)",
                              param="quantization")
        layers[name] = parts
    return layers, dense


def _dequantize_any(ggml_type: int, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    if ggml_type == Q4_1:
        codes, d, m = q4_1_blocks(blocks.numpy(), blocks.shape[0], cols)
        return d.repeat_interleave(INT4_GROUP, 1) * codes.float() + m.repeat_interleave(
            INT4_GROUP, 1)
    return dequantize(blocks, ggml_type, cols)


def _write_cache(layers: dict[str, Parts], dense: set[str], cache: Path) -> None:
    """`<module>.<part>.<ggml type>` -> bytes, `<module>.dense` for an unquantised layer;
    written to a temporary name and renamed (a crash leaves no half file)."""
    from safetensors.torch import save_file

    tensors = {f"{name}.{i}.{t}": b.contiguous() for name, parts in layers.items()
               for i, (t, b) in enumerate(parts)}
    tensors |= {f"{name}.dense": torch.zeros(1, dtype=torch.uint8) for name in dense}
    tmp = cache.with_name(f".{cache.name}.{os.getpid()}")
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(tmp))
        os.replace(tmp, cache)
    except OSError:  # a read-only cache folder: extract again next time
        tmp.unlink(missing_ok=True)


def _read_cache(cache: Path) -> tuple[dict[str, Parts], set[str]]:
    from safetensors import safe_open

    layers: dict[str, dict[int, tuple[int, torch.Tensor]]] = {}
    dense: set[str] = set()
    with safe_open(str(cache), framework="pt") as f:
        for key in f.keys():
            if key.endswith(".dense"):
                dense.add(key.removesuffix(".dense"))
                continue
            name, part, ggml_type = key.rsplit(".", 2)
            layers.setdefault(name, {})[int(part)] = (int(ggml_type), f.get_tensor(key))
    return {name: [parts[i] for i in sorted(parts)] for name, parts in layers.items()}, dense
