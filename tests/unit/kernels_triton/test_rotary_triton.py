"""Triton rotary embedding against the torch reference for every rope variant our models use,
on strided q/k views, with odd head counts and a head_dim whose half is not a power of two."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from tests.unit.kernels_triton.triton_helpers import DEVICE, DTYPES

from shoal.kernels.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin
from shoal.kernels.rotary_triton import apply_rotary_triton

VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r["rope_type"])
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 1, 24)])
def test_matches_reference(dtype: torch.dtype, rope: dict, num_heads: int, num_kv_heads: int,
                           head_dim: int) -> None:
    gen = fresh_generator()
    cos_sin = rotary_cos_sin(rope_inv_freq(rope, head_dim, 256, max_model_len=512), 512).to(DEVICE)
    num_tokens = 7
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim,
                      generator=gen).to(dtype).to(DEVICE)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim,
                         num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    positions[0] = 0
    q_out, k_out = apply_rotary_triton(q, k, positions, cos_sin)
    q_ref, k_ref = apply_rotary(q, k, positions, cos_sin)
    # every product and sum is rounded as torch rounds it; only an FMA on the GPU may differ
    tol = {"atol": 1e-6, "rtol": 1e-6} if dtype == torch.float32 else {"atol": 0.0, "rtol": 0.0}
    if DEVICE.type == "cuda" and dtype != torch.float32:
        tol = {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(q_out, q_ref, **tol)
    torch.testing.assert_close(k_out, k_ref, **tol)
    assert torch.equal(q_out[0], q[0]) and torch.equal(k_out[0], k[0])  # position 0: identity
