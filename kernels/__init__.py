"""shoal.kernels: the engine's compute ops behind one seam, `Ops`, chosen per device.

Each op is plain torch (the reference, and the CPU path where no compiler is found), Triton (the
CUDA path, beside it in `*_triton.py`), and a C++ op built for this CPU at first use
(`cpu_ops.py`, the CPU path); `select_ops` picks the set by device, so the model code never
changes (docs/architecture.md "KV-cache contract").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace

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
    note: str = ""
    """Why this set stands in for a faster one, for the engine's start line ("" if it does not)."""

    def describe(self) -> str:
        return f"{self.name} ops" + (f" ({self.note})" if self.note else "")


TORCH_OPS = Ops(reshape_and_cache=reshape_and_cache, paged_attention=paged_attention,
                rms_norm=rms_norm, apply_rotary=apply_rotary, name="torch")


def select_ops(device: torch.device | str, force: str | None = None) -> Ops:
    """The op set for a device: Triton on CUDA, the C++ CPU ops elsewhere (plain torch where they
    cannot be built). `force` ("torch", "cpp" or "triton") overrides the choice (tests run the
    Triton set on CPU under TRITON_INTERPRET=1). Triton is imported only here, so
    `import shoal.kernels` works where it is absent."""
    name = force or ("triton" if torch.device(device).type == "cuda" else "cpp")
    if name == "torch":
        return TORCH_OPS
    if name == "cpp":
        return _cpp_ops()
    if name != "triton":
        raise ValueError(f"unknown op set {name!r} (torch, cpp or triton)")
    try:
        from shoal.kernels.triton_ops import TRITON_OPS
    except ImportError:
        if force:
            raise
        warnings.warn("triton is not installed: CUDA runs the plain-torch ops", stacklevel=2)
        return replace(TORCH_OPS, note="triton is not installed")
    return TRITON_OPS


def _cpp_ops() -> Ops:
    from shoal.kernels import cpu_ops

    if (reason := cpu_ops.unavailable_reason()) is not None:
        return replace(TORCH_OPS, note=f"C++ ops unavailable: {reason}")
    return Ops(reshape_and_cache=cpu_ops.reshape_and_cache,
               paged_attention=cpu_ops.paged_attention, rms_norm=cpu_ops.rms_norm,
               apply_rotary=cpu_ops.apply_rotary, name="cpp")


__all__ = ["Ops", "Workspace", "TORCH_OPS", "select_ops", "paged_attention", "reshape_and_cache",
           "rms_norm",
           "apply_rotary"]
