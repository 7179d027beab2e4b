"""The gated activations over the packed gate_up output: act(gate) * up, act from the config's
`hidden_activation` (Gemma) or `hidden_act`: SiLU (SwiGLU: Llama, Qwen, Phi-3, Granite) or GELU
(GeGLU: Gemma's gelu_pytorch_tanh, the tanh approximation). On CPU SiLU's chain is one call
into the C++ library (`cpu_ops.silu_and_mul`: torch's own kernels, so the same bits)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shoal.kernels import cpu_ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        if x.is_cpu and cpu_ops.load():  # the same kernels, one dispatch (issue 31)
            return cpu_ops.silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    def __init__(self, approximate: str = "none") -> None:
        super().__init__()
        self.approximate = approximate

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, 2 * inter] -> [n, inter]
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate=self.approximate) * up


GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def gated_activation(cfg: Any) -> nn.Module:
    """The MLP's activation by transformers' ACT2FN name; another name is refused."""
    from shoal.services.engine.config import ConfigError

    name = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "silu"
    if name in ("silu", "swish"):
        return SiluAndMul()
    if name in GELU_TANH:
        return GeluAndMul("tanh")
    if name == "gelu":
        return GeluAndMul()
    raise ConfigError(f"hidden activation {name!r} is not supported (silu, gelu, "
                      f"{', '.join(GELU_TANH)})")


class ClampedSwiGLU:
    """gpt-oss's expert activation: gate clamped to <= limit, up to [-limit, limit], then
    (up + 1) * gate * sigmoid(alpha * gate) (transformers' GptOssExperts; alpha 1.702, limit 7:
    the sigmoid approximation of GELU, bounded so that bf16/MXFP4 activations stay finite)."""

    def __init__(self, alpha: float = 1.702, limit: float = 7.0) -> None:
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
