"""Weights prepared once after loading for the CPU's fast matmul kernels.

torch's `F.linear` on CPU calls MKL's sgemm, which on this project's AMD EPYC (AVX-512) runs at
less than half of what oneDNN's JIT kernels reach for the same fp32 matmuls (about 110 against
230-260 GFLOP/s on one core at 64-256 rows; docs/figures.md). So on CPU every Linear and the LM
head get their weight reordered once into oneDNN's blocked layout and run through
`torch.ops.mkldnn._linear_pointwise` (the op inductor's CPU freezing pass emits); the dense copy
of a Linear's weight is released. `quantization="int8"` stores int8 weights with one scale per
output row instead (weight-only, symmetric), through `torch._weight_int8pack_mm`; its CPU kernel
is vectorised for bf16 activations only (fp32 ones take a scalar path 20-60x slower), so the
activations enter the matmul in bf16 and leave in the model's dtype.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from shoal.services.engine.config import QUANTIZATIONS, ConfigError


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                              "_linear_pointwise")


class OneDNNLinear:
    """y = x W^T + b with W reordered for oneDNN (fp32 or bf16)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach())
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


class Int8Linear:
    """Weight-only int8: symmetric per output row, scale = max |w| / 127."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)  # [out]
        self.qweight = (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8).contiguous()
        self.scale = scale.to(torch.bfloat16)
        self.bias = None if bias is None else bias.detach()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = torch._weight_int8pack_mm(x.to(torch.bfloat16).contiguous(), self.qweight,
                                        self.scale).to(x.dtype)
        return out if self.bias is None else out + self.bias

    def dequantized(self) -> torch.Tensor:
        return self.qweight.float() * self.scale.float()[:, None]


def prepare_cpu_weights(model: nn.Module, quantization: str | None) -> str:
    """Give every Linear and the LM head its CPU kernel; returns what was used (for the log)."""
    from shoal.services.engine.layers.embedding import LMHead
    from shoal.services.engine.layers.linear import Linear

    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ConfigError(f"quantization must be one of {QUANTIZATIONS}, got {quantization!r}",
                          param="quantization")
    make: Callable[[torch.Tensor, torch.Tensor | None], Callable[..., torch.Tensor]] | None
    if quantization == "int8":
        make, used = Int8Linear, "int8 weight-only (torch._weight_int8pack_mm, bf16 activations)"
    elif onednn_available():
        make, used = OneDNNLinear, "oneDNN packed weights"
    else:
        return "torch F.linear"
    for module in model.modules():
        if isinstance(module, Linear):
            module.kernel = make(module.weight, module.bias)
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)  # the kernel's copy
        elif isinstance(module, LMHead):  # tied: the embedding keeps the dense weight
            module.kernel = make(module.weight, None)
    return used
