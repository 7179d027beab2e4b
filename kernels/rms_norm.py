"""RMSNorm with an optional fused residual add (plain torch: the CPU path and the reference).

Computed in float32 and in the same order as transformers' LlamaRMSNorm, so fp32 results match
it bit for bit: `weight * (x * rsqrt(mean(x^2) + eps))`.
"""

from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: the normalised x. With it: (norm(x + residual), x + residual)."""
    dtype = x.dtype
    if residual is not None:
        x = x + residual
        residual = x
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = weight * h.to(dtype)
    return out if residual is None else (out, residual)
