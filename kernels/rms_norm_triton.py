"""Fused residual-add + RMSNorm in Triton: one program per row, fp32 inside, rounded to the input
dtype exactly where the torch reference rounds (the sum, the normalised row, the product)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._utils import check_same_device, next_power_of_2


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n_inner, stride_outer,
                     stride_inner, res_stride_outer, res_stride_inner, eps,
                     N: tl.constexpr, BLOCK_N: tl.constexpr, HAS_RESIDUAL: tl.constexpr):
    row = tl.program_id(0)
    outer, inner = row // n_inner, row % n_inner
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(x_ptr + outer * stride_outer + inner * stride_inner + offs, mask=mask,
                other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + outer * res_stride_outer + inner * res_stride_inner + offs, mask=mask,
                    other=0.0).to(tl.float32)
        x = (x + r).to(dtype).to(tl.float32)  # torch adds in the input dtype
        tl.store(res_out_ptr + row * N + offs, x.to(dtype), mask=mask)
    var = tl.sum(x * x, axis=0) / N
    h = (x * (1.0 / tl.sqrt(var + eps))).to(dtype).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (w * h).to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> tuple[int, int, int]:
    """(n_inner, stride_outer, stride_inner): row r sits at (r // n_inner, r % n_inner)."""
    assert x.stride(-1) == 1, f"the normalised dim must be dense, strides {x.stride()}"
    if x.dim() == 2:
        return 1, x.stride(0), 0
    assert x.dim() == 3, f"rms_norm takes 2-D or 3-D input, got {tuple(x.shape)}"
    return x.shape[1], x.stride(0), x.stride(1)


def rms_norm_triton(
    x: torch.Tensor,  # [num_tokens, hidden] or [num_tokens, num_heads, head_dim] (q/k norms)
    weight: torch.Tensor,  # [hidden]
    eps: float,
    residual: torch.Tensor | None = None,  # same shape as x
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Without residual: the normalised x. With it: (norm(x + residual), x + residual)."""
    n = x.shape[-1]
    assert weight.shape == (n,) and weight.is_contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_inner, s_outer, s_inner = _rows(x)
    num_rows = x.numel() // n if n else 0
    res_out, r_outer, r_inner = out, 0, 0
    if residual is not None:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        check_same_device(x, residual, weight)
        res_n_inner, r_outer, r_inner = _rows(residual)
        assert res_n_inner == n_inner
        res_out = torch.empty_like(out)
    if num_rows:
        _rms_norm_kernel[(num_rows,)](x, residual if residual is not None else x, weight, out,
                                      res_out, n_inner, s_outer, s_inner, r_outer, r_inner, eps,
                                      N=n, BLOCK_N=next_power_of_2(n),
                                      HAS_RESIDUAL=residual is not None)
    return out if residual is None else (out, res_out)
