"""TRITON_OPS: the CUDA op set, call-compatible with the torch set (shoal.kernels.TORCH_OPS).
Importing this module imports triton; `select_ops` imports it only when asked for Triton."""

from __future__ import annotations

from shoal.kernels import Ops
from shoal.kernels.paged_attention_triton import paged_attention_triton
from shoal.kernels.reshape_and_cache_triton import reshape_and_cache_triton
from shoal.kernels.rms_norm_triton import rms_norm_triton
from shoal.kernels.rotary_triton import apply_rotary_triton

TRITON_OPS = Ops(reshape_and_cache=reshape_and_cache_triton,
                 paged_attention=paged_attention_triton, rms_norm=rms_norm_triton,
                 apply_rotary=apply_rotary_triton, name="triton")
