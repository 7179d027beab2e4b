"""The C++ RMSNorm and rotary ops (csrc/cpu_norm_rotary.cpp) against the torch references: one
token (the serial path) and many (the parallel path), fp32 and bf16, the residual add, and q/k as
strided views of a packed qkv projection, as the model hands them over."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.seeding import fresh_generator

from shoal.kernels import cpu_ops
from shoal.kernels.rms_norm import rms_norm
from shoal.kernels.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")


@pytest.mark.parametrize("tokens", [1, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_torch(tokens: int, dtype: torch.dtype) -> None:
    gen = fresh_generator()
    x = (torch.randn(tokens, 576, generator=gen) * 3).to(dtype)
    res = torch.randn(tokens, 576, generator=gen).to(dtype)
    w = torch.randn(576, generator=gen).to(dtype)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), **tol)
    out, summed = cpu_ops.rms_norm(x, w, 1e-5, residual=res)
    ref_out, ref_summed = rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(summed, ref_summed)  # the add itself is exact in either dtype
    torch.testing.assert_close(out, ref_out, **tol)
    assert out.dtype == dtype and summed.dtype == dtype


@pytest.mark.parametrize("tokens", [1, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_torch_on_packed_qkv_views(tokens: int, dtype: torch.dtype) -> None:
    gen = fresh_generator()
    heads, kv_heads, dim = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k = q.view(tokens, heads, dim), k.view(tokens, kv_heads, dim)  # strided, as in llama.py
    cos_sin = rotary_cos_sin(rope_inv_freq({"rope_type": "default", "rope_theta": 1e5}, dim,
                                           4096), 4096)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    q_out, k_out = cpu_ops.apply_rotary(q, k, positions, cos_sin)
    q_ref, k_ref = apply_rotary(q, k, positions, cos_sin)
    assert torch.equal(q_out, q_ref) and torch.equal(k_out, k_ref)  # same arithmetic, no FMA
    assert torch.equal(qkv[:, :heads * dim].view(tokens, heads, dim), q)  # inputs untouched


def test_rotary_names_a_position_outside_its_cache() -> None:
    cos_sin = rotary_cos_sin(rope_inv_freq({"rope_type": "default", "rope_theta": 1e4}, 16,
                                           8), 8)
    q = torch.randn(1, 2, 16)
    with pytest.raises(RuntimeError, match="position out of the rotary cache"):
        cpu_ops.apply_rotary(q, q, torch.tensor([8]), cos_sin)


@pytest.mark.parametrize("tokens", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [1536, 37])  # (37: a vector tail)
def test_silu_and_mul_equals_the_torch_chain(tokens: int, dtype: torch.dtype, inter: int,
                                             threads: int) -> None:
    gen = fresh_generator()
    x = (torch.randn(tokens, 2 * inter, generator=gen) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    out = cpu_ops.silu_and_mul(x)
    assert out.shape == (tokens, inter) and out.dtype == dtype
    assert torch.equal(out, F.silu(gate) * up)  # torch's kernels on the same views: same bits
    with pytest.raises(RuntimeError, match="2 \\* inter"):
        cpu_ops.silu_and_mul(x[:, 1:])
