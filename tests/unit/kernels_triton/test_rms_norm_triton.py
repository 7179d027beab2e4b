"""Triton RMSNorm (with and without the fused residual add) against the torch reference:
odd widths, SmolLM2's 576, and 3-D per-head input taken as a strided view (Qwen3's q/k norms)."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from tests.unit.kernels_triton.triton_helpers import DEVICE, DTYPES, tolerance

from shoal.kernels import rms_norm
from shoal.kernels.rms_norm_triton import rms_norm_triton


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_tokens,hidden", [(1, 16), (7, 37), (5, 576)])
def test_matches_reference(dtype: torch.dtype, num_tokens: int, hidden: int) -> None:
    gen = fresh_generator()
    x = (torch.randn(num_tokens, hidden, generator=gen) * 3).to(dtype).to(DEVICE)
    res = torch.randn(num_tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    w = torch.randn(hidden, generator=gen).to(dtype).to(DEVICE)
    tol = tolerance(dtype)
    torch.testing.assert_close(rms_norm_triton(x, w, 1e-6), rms_norm(x, w, 1e-6), **tol)
    out, new_res = rms_norm_triton(x, w, 1e-5, residual=res)
    ref, ref_res = rms_norm(x, w, 1e-5, residual=res)
    torch.testing.assert_close(out, ref, **tol)
    assert torch.equal(new_res, ref_res)  # one rounded add: exact


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_per_head_strided_view(dtype: torch.dtype) -> None:
    gen = fresh_generator()
    num_tokens, num_heads, num_kv_heads, head_dim = 6, 4, 2, 32
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=gen).to(dtype).to(DEVICE)
    q = qkv[:, :num_heads * head_dim].view(num_tokens, num_heads, head_dim)  # not contiguous
    w = torch.rand(head_dim, generator=gen).to(dtype).to(DEVICE) + 0.5
    out = rms_norm_triton(q, w, 1e-6)
    assert out.shape == q.shape
    torch.testing.assert_close(out, rms_norm(q, w, 1e-6), **tolerance(dtype))
