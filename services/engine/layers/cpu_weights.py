"""Weights prepared once after loading for the CPU's fast matmul kernels.

torch's `F.linear` on CPU calls MKL's sgemm, which runs at less than half of what oneDNN's JIT
kernels reach for the same fp32 matmuls (docs/figures.md). So on CPU every Linear and the LM head
get their weight reordered once into oneDNN's blocked layout and run through
`torch.ops.mkldnn._linear_pointwise` (the op inductor's CPU freezing pass emits). oneDNN's kernels
are built for many rows: a step of up to `cpu_ops.PANEL_MAX_ROWS` tokens (decode, a single
stream's or a batch's) instead runs `cpu_ops.panel_matmul` over the weight packed at load into
the MoE experts' k-major panels of 32 output rows (kernels/csrc/cpu_moe.cpp: a dense Linear is
one expert with every row routed to it), 0.56-0.87x oneDNN's time at 1-32 rows and 0.7x the
plain-layout C++ GEMV's at one row (docs/figures.md "dense16"). That copy beside oneDNN's is one
more copy of every Linear's weight (it replaced the GEMV's plain one), so `cpu_gemv`
(EngineConfig) decides: None keeps it when it takes under an eighth of the machine's memory;
False releases it (and runs every step through oneDNN). The LM head keeps the panels alone
(`PanelLinear`): they took 0.96-1.03x oneDNN's time from 64 rows to 512, so the head needs no
second copy (a tied one's plain weight is the embedding table anyway).

An MoE's experts (layers/moe.py) get the same kernels, one pair per expert, from their slices
of the stacked weights (the router stays a plain fp32 matmul).

Quantised weights (`quantization=`), for batch 1, which reads every weight once per token:
- "int8": int8 weights, one scale per output row: where AVX-512 VNNI is built, the step's
  rows quantised to int8 blocks of 32 and integer dot products (`int8_matmul_q8`,
  kernels/csrc/cpu_gguf.cpp) for a step of one row (1.5x torch's kernel there, level at two),
  else `torch._weight_int8pack_mm` (bf16 activations: its fp32 path is scalar).
- "int4": 4-bit weights in groups of 32 along the input, a scale and a zero per group (affine:
  w = scale * (q - 8) + zero), through `torch._weight_int4pack_mm_for_cpu` (bf16 activations; its
  fp32 and fp16 paths are scalar).
- "gguf" (a .gguf model's default on one rank): the file's own blocks (gguf_weights.py): Q4_1 as
  the int4 layout below, Q8_0 / K-quants through the C++ block matmul (kernels/csrc/cpu_gguf.cpp).
Those weight-only kernels are 2-3x slower than oneDNN fp32 per FLOP, so from `MANY_ROWS` tokens
a step (prefill, batches) the same (dequantised) weights run a second kernel, `ManyRows`: a
oneDNN bf16 GEMM (AMX / AVX512-BF16) where the CPU has one, else a dynamic int8 GEMM
(`torch._int_mm`, activations quantised per token). The bf16 GEMM won on quality (int8
activations cost SmolLM2 3 % of perplexity) at about the same speed (docs/figures.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from shoal.kernels import cpu_ops
from shoal.services.engine.config import QUANTIZATIONS, ConfigError

if TYPE_CHECKING:
    from shoal.services.engine.layers.gguf_weights import GGUFSource


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")


class PanelLinear:
    """y = x W^T + b, float32, every step through `cpu_ops.panel_matmul` over W packed by
    `cpu_ops.dense_pack` (the LM head's kernel; OneDNNLinear's for small steps)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.panels = cpu_ops.dense_pack(weight)
        self.out_features = weight.shape[0]
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_ops.panel_matmul(x, self.panels, self.bias, self.out_features)


class OneDNNLinear:
    """y = x W^T + b with W reordered for oneDNN (fp32 or bf16); with `panels` (float32 only),
    steps of up to PANEL_MAX_ROWS rows run `PanelLinear` over W's packed panels instead."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 panels: bool = False) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()
        self.small = PanelLinear(weight, bias) if panels else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.small is not None and x.shape[0] <= cpu_ops.PANEL_MAX_ROWS:
            return self.small(x)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def gemv_available(dtype: torch.dtype) -> bool:
    """Whether weights of `dtype` can have the small-rows panel kernel (float32, C++ ops built)."""
    return dtype == torch.float32 and onednn_available() and cpu_ops.load()


def keep_plain_weights(extra_bytes: int, cpu_gemv: bool | None) -> bool:
    """Whether the Linears keep a second copy of their weights for the small-rows kernel (the
    panels; a plain copy for the GEMV before them; see the docstring)."""
    if cpu_gemv is not None:
        return cpu_gemv
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return extra_bytes * 8 <= memory


MANY_ROWS = 8
"""Rows (tokens in a step) from which quantised layers use `ManyRows`: below it the weight-only
kernels won on the AVX-512/AMX Xeon of docs/figures.md."""


def dynamic_int8_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] float @ (qweight [N, K] int8 * scale [N])^T, x quantised per row (symmetric)."""
    xf = x.float()
    step = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0
    xq = (xf / step).round_().to(torch.int8)
    return torch._int_mm(xq, qweight.t()) * (step * scale)


def bf16_gemm_available() -> bool:
    return onednn_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


class ManyRows:
    """The many-rows kernel of a quantised layer, from its dequantised weight [N, K] fp32:
    oneDNN bf16 (a bf16 copy, 2 bytes a weight) or dynamic int8 (an int8 copy, 1 byte)."""

    def __init__(self, dense: torch.Tensor) -> None:
        self.bf16 = bf16_gemm_available()
        if self.bf16:
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.to(torch.bfloat16))
        else:
            self.qweight, self.scale = _per_row_int8(dense)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.bf16:
            return torch.ops.mkldnn._linear_pointwise(x.to(torch.bfloat16), self.packed, None,
                                                      "none", [], "").to(x.dtype)
        return dynamic_int8_mm(x, self.qweight, self.scale).to(x.dtype)

    @staticmethod
    def describe() -> str:
        return ("oneDNN bf16 GEMM" if bf16_gemm_available()
                else "dynamic int8 GEMM (torch._int_mm)")


def _per_row_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one fp32 scale per output row: scale = max |w| / 127."""
    w = w.detach().float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous(), scale


class Int8Linear:
    """Weight-only int8: symmetric per output row, scale = max |w| / 127."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.qweight, scale = _per_row_int8(weight)
        self.scale = scale.to(torch.bfloat16)  # what _weight_int8pack_mm takes
        self.bias = None if bias is None else bias.detach()
        self.many = ManyRows(self.dequantized())
        self.q8 = cpu_ops.q8_available(self.qweight.shape[1])
        self.scale_f32 = self.scale.float()  # the same (bf16-rounded) scales, for int8_matmul_q8

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.q8 and x.shape[0] <= cpu_ops.Q8_INT8_MAX_ROWS:  # int8 activations, VNNI
            out = torch.ops.shoal_cpu.int8_matmul_q8(x.float().contiguous(), self.qweight,
                                                     self.scale_f32).to(x.dtype)
        elif x.shape[0] >= MANY_ROWS:
            out = self.many(x)
        else:
            out = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight,
                                            self.scale).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]


INT4_GROUP = 32
"""Input elements per int4 scale/zero: GGUF's Q4_0/Q4_1 block size, the smallest torch takes."""


class Int4Linear:
    """Weight-only int4, group-wise affine: w[n, k] = scale[n, g] * (q[n, k] - 8) + zero[n, g]
    with q in 0..15 and g = k // 32 (torch's int4 CPU layout). Built from a float weight (min/max
    per group) or from given codes, scales and zeros (`from_codes`: a GGUF's Q4_1 blocks)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        out_f, in_f = w.shape
        if in_f % INT4_GROUP:
            raise ConfigError(f"int4 needs input sizes divisible by {INT4_GROUP}, got {in_f}",
                              param="quantization")
        groups = w.view(out_f, in_f // INT4_GROUP, INT4_GROUP)
        low, high = groups.amin(dim=2), groups.amax(dim=2)
        step = ((high - low) / 15.0).clamp(min=1e-12)
        codes = ((groups - low[..., None]) / step[..., None]).round().clamp(0, 15)
        self._build(codes.view(out_f, in_f).to(torch.int32), step, low, bias)

    @classmethod
    def from_codes(cls, codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor,
                   bias: torch.Tensor | None) -> Int4Linear:
        """codes [N, K] in 0..15, step and low [N, K / 32]: w = step * code + low per group."""
        layer = cls.__new__(cls)
        layer._build(codes.to(torch.int32), step.float(), low.float(), bias)
        return layer

    def _build(self, codes: torch.Tensor, step: torch.Tensor, low: torch.Tensor,
               bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        scale = step.to(torch.bfloat16)  # what the kernel takes: bf16 scales and zeros
        zero = (low + 8.0 * step).to(torch.bfloat16)  # torch's kernel: scale * (q - 8) + zero
        self.scales_and_zeros = torch.stack([scale.t(), zero.t()], dim=-1).contiguous()
        self.bias = None if bias is None else bias.detach()
        self.many = ManyRows(int4_dequantize(codes, scale.float(), zero.float()))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] >= MANY_ROWS:
            out = self.many(x)
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.to(torch.bfloat16).contiguous(), self.packed, INT4_GROUP,
                self.scales_and_zeros).to(x.dtype)
        return out if self.bias is None else out + self.bias


def int4_dequantize(codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """The reference: w = scale * (code - 8) + zero per group of 32; codes [N, K], scale and
    zero [N, K / 32] -> [N, K] fp32."""
    out_f, in_f = codes.shape
    groups = codes.float().view(out_f, in_f // INT4_GROUP, INT4_GROUP)
    return (scale.float()[..., None] * (groups - 8.0) + zero.float()[..., None]).view(out_f, in_f)


def gguf_source(model: str) -> Path | None:
    """The .gguf file a model source names (quantization "gguf" reads its blocks), else None."""
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def resolve_quantization(quantization: str | None, model: str, world_size: int) -> str | None:
    """The CPU path's weights for EngineConfig.quantization: unset, a .gguf model on one rank
    runs its own blocks ("gguf", what a user of the file expects: its size and speed); "none"
    asks for the checkpoint's dtype (a .gguf dequantised, the reference); else as given."""
    if quantization == "none":
        return None
    if quantization is None and world_size == 1 and gguf_source(model) is not None:
        return "gguf"
    return quantization


def wants_gguf_blocks(model: str, device: str, quantization: str | None, world_size: int
                      ) -> bool:
    """Whether an engine runs a .gguf's own blocks (on the CPU, quantization "gguf"): then its
    model folder need not hold the Linear weights the blocks bring (model_prep's gguf_blocks)."""
    on_cpu = device == "cpu" or (device == "auto" and not _cuda_available())
    return on_cpu and resolve_quantization(quantization, model, world_size) == "gguf"


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def keep_many_rows_copies(layers: dict[str, Callable[..., torch.Tensor]]) -> str:
    """Give the GGUF block layers a ManyRows copy of their weight for prefill and batches when
    those copies take under an eighth of memory (as keep_plain_weights): else every such step
    unpacks each weight afresh, which cost a 512-token prefill at 1B shapes 1.4-2x bf16's time
    (benchmarks/gguf_kernels.py --prefill). Returns the start line's note."""
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    blocks = [k for k in layers.values() if isinstance(k, GGUFBlockLinear)]
    extra = sum(k.dense_numel() for k in blocks) * (2 if bf16_gemm_available() else 1)
    if not blocks or not keep_plain_weights(extra, None):
        return ""
    for kernel in blocks:
        kernel.keep_many_rows()
    return f"; from {MANY_ROWS} rows {ManyRows.describe()} (+{extra / 2**20:.0f} MiB kept for it)"


def gguf_summary(layers: dict[str, Callable[..., torch.Tensor]]) -> str:
    """'Q4_K x 97, Q6_K x 25, ...': which block kernels a GGUF's layers got (the start line)."""
    from shoal.services.engine.layers.gguf_weights import TYPE_NAMES, GGUFBlockLinear

    counts: dict[str, int] = {}
    for kernel in layers.values():
        if isinstance(kernel, GGUFBlockLinear):
            for ggml_type, _ in kernel.parts:
                counts[TYPE_NAMES[ggml_type]] = counts.get(TYPE_NAMES[ggml_type], 0) + 1
        elif isinstance(kernel, Int4Linear):
            counts["Q4_1 as int4"] = counts.get("Q4_1 as int4", 0) + 1
    return ", ".join(f"{k} x {v}" for k, v in sorted(counts.items())) or "no quantised layers"


def prepare_cpu_weights(model: nn.Module, quantization: str | None,
                        gguf: Path | GGUFSource | None = None, gguf_cache: Path | None = None,
                        cpu_gemv: bool | None = None, check_gguf: bool = True) -> str:
    """Give every Linear and the LM head its CPU kernel; returns what was used (for the log).
    `gguf`: the file the model was converted from (quantization "gguf" reads its blocks), or
    that file already parsed;
    `gguf_cache`: where those blocks are kept once extracted (gguf_weights.py); `cpu_gemv`:
    EngineConfig's (whether the Linears keep a panel copy of their weights for small steps);
    `check_gguf`: compare the blocks with the loaded weights (false for a GGUF blocks folder,
    which loaded none)."""
    from shoal.services.engine.layers.embedding import LMHead
    from shoal.services.engine.layers.linear import Linear
    from shoal.services.engine.layers.moe import StackedExperts

    if quantization == "none":
        quantization = None
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}",
                          param="quantization")
    make: Callable[[torch.Tensor, torch.Tensor | None], Callable[..., torch.Tensor]]
    head: Callable[[torch.Tensor, torch.Tensor | None], Callable[..., torch.Tensor]]
    layers: dict[str, Callable[..., torch.Tensor]] = {}
    dense: set[str] = set()
    if quantization == "gguf":
        if gguf is None:
            raise ConfigError('quantization "gguf" needs the model given as a .gguf file',
                              param="quantization")
        from shoal.services.engine.layers.gguf_weights import gguf_layers

        layers, dense = gguf_layers(model, gguf, gguf_cache, check_gguf)
        if not layers:  # an unquantised file (F32 / F16): the dense kernels, as without
            quantization = None
    if quantization == "int8":
        make = head = Int8Linear
        small = f"torch._weight_int8pack_mm below {MANY_ROWS} rows"
        if cpu_ops.q8_available(64):
            small = f"int8-activation VNNI kernel at {cpu_ops.Q8_INT8_MAX_ROWS} row, " + small
        used = f"int8 weights ({small}, {ManyRows.describe()} from there)"
    elif quantization == "int4":
        make, head = Int4Linear, Int8Linear
        used = (f"int4 weights, groups of {INT4_GROUP} (torch._weight_int4pack_mm_for_cpu below "
                f"{MANY_ROWS} rows, {ManyRows.describe()} from there), int8 LM head")
    elif quantization == "gguf":
        used = f"the GGUF's own blocks ({gguf_summary(layers)}; {len(dense)} unquantised layers"
        used += " fp32 oneDNN), int8 from the dequantised weight for any other layer"
        used += keep_many_rows_copies(layers)
        make = head = Int8Linear  # a layer stored in another type (Q2_K, IQ...): int8
        for name in dense:
            module = model.get_submodule(name)
            layers[name] = OneDNNLinear(module.weight, getattr(module, "bias", None),
                                        panels=gemv_available(module.weight.dtype))
    elif onednn_available():
        make = head = OneDNNLinear
        used = "oneDNN packed weights"
        weights = [m.weight for m in model.modules() if isinstance(m, Linear)]
        weights += [w for m in model.modules() if isinstance(m, StackedExperts)
                    for w in (m.w13, m.w2)]
        if gemv_available(weights[0].dtype if weights else torch.float32):
            head = PanelLinear  # instead of oneDNN's copy, not beside it
            extra = sum(w.numel() * w.element_size() for w in weights)
            if keep_plain_weights(extra, cpu_gemv):
                make = partial(OneDNNLinear, panels=True)
                used += (f"; steps of up to {cpu_ops.PANEL_MAX_ROWS} tokens: packed panels "
                         f"(+{extra / 2**20:.0f} MiB kept for them); LM head: panels")
            else:
                used += (f"; packed panels for the LM head only (the Linears' second copy, "
                         f"{extra / 2**20:.0f} MiB, released: cpu_gemv false, or over an "
                         "eighth of memory)")
    else:
        return "torch F.linear"
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            module.kernel = (layers[name] if quantization == "gguf" and name in layers
                             else make(module.weight, module.bias))
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # the kernel's copy
        elif isinstance(module, LMHead):  # tied: the embedding keeps the dense weight
            module.kernel = layers[name] if name in layers else head(module.weight, None)
        elif isinstance(module, StackedExperts):  # each expert's two matmuls, as a Linear's
            b13, b2 = module.w13_bias, module.w2_bias  # (gpt-oss's biases: None elsewhere)
            plain = isinstance(make, partial) and make.keywords.get("panels", False)
            # Where the Linears keep a panel copy of their fp32 weights, the experts keep theirs
            # packed for moe_forward instead (the same bytes); their own kernels, for larger
            # steps, are oneDNN's alone.
            expert_make = OneDNNLinear if plain else make
            module.kernels = [(expert_make(module.w13[e], None if b13 is None else b13[e]),
                               expert_make(module.w2[e], None if b2 is None else b2[e]))
                              for e in range(module.num_experts)]
            if plain:
                module.packed = cpu_ops.moe_pack(module.w13.data, module.w2.data)
            for param in (module.w13, module.w2):
                param.data = torch.empty(0, dtype=param.dtype)
    return used
