"""shoal.kernels: the engine's compute ops behind one seam, `Ops`, chosen per device.

Each op is plain torch today (the CPU path and the reference); a Triton set for CUDA plugs in
through `select_ops` without the model code changing (DESIGN.md "KV-cache contract").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.kernels.paged_attention import Workspace, paged_attention
from shoal.kernels.reshape_and_cache import reshape_and_cache
from shoal.kernels.rms_norm import rms_norm
from shoal.kernels.rotary import apply_rotary


@dataclass(frozen=True, slots=True)
class Ops:
    reshape_and_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor | tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    name: str = "torch"


TORCH_OPS = Ops(reshape_and_cache=reshape_and_cache, paged_attention=paged_attention,
                rms_norm=rms_norm, apply_rotary=apply_rotary, name="torch")


def select_ops(device: torch.device | str) -> Ops:
    """The op set for a device: plain torch for now on every device (Triton for CUDA comes next)."""
    del device
    return TORCH_OPS


__all__ = ["Ops", "Workspace", "TORCH_OPS", "select_ops", "paged_attention", "reshape_and_cache", "rms_norm",
           "apply_rotary"]
