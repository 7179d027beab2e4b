"""rms_norm against transformers' LlamaRMSNorm (bit-identical in fp32) and a float64 formula."""

from __future__ import annotations

import torch
from tests.seeding import fresh_generator
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from shoal.kernels import rms_norm


def test_matches_transformers_and_float64() -> None:
    gen = fresh_generator()
    x = torch.randn(7, 37, generator=gen) * 3
    ref = LlamaRMSNorm(37, eps=1e-6)
    ref.weight.data = torch.randn(37, generator=gen)
    out = rms_norm(x, ref.weight.data, 1e-6)
    assert torch.equal(out, ref(x))
    x64 = x.double()
    expect = x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / 37 + 1e-6) * ref.weight.double()
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)


def test_fused_residual_returns_sum() -> None:
    gen = fresh_generator()
    x, res = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    w = torch.randn(16)
    out, new_res = rms_norm(x, w, 1e-5, residual=res)
    assert torch.equal(new_res, x + res)
    assert torch.equal(out, rms_norm(x + res, w, 1e-5))
