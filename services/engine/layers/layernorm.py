"""RMSNorm module over ops.rms_norm (with the residual add fused in, as vLLM's layers do)."""

from __future__ import annotations

import torch
from torch import nn

from shoal.kernels import Ops
from shoal.services.engine.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, ops: Ops) -> None:
        super().__init__()
        self.eps = eps
        self.ops = ops
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rms_norm(x, self.weight, self.eps, residual)
