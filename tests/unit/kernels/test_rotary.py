"""Rotary embedding: inverse frequencies equal transformers' per rope variant, rotation equals a
complex-number reference, and applying it matches transformers' apply_rotary_pos_emb exactly."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from shoal.kernels.rotary import apply_rotary, rope_inv_freq, rotary_cos_sin

VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
]


def _config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=256, rope_parameters=dict(rope))


@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r["rope_type"])
def test_inv_freq_and_rotation_match_transformers(rope: dict) -> None:
    config = _config(rope)
    ours = rope_inv_freq(rope, 32, 256, max_model_len=256)
    if rope["rope_type"] != "default":
        theirs, _ = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu", seq_len=256)
        assert torch.equal(ours, theirs)
    gen = fresh_generator()
    positions = torch.randint(0, 256, (9,), generator=gen)
    q, k = torch.randn(9, 4, 32, generator=gen), torch.randn(9, 2, 32, generator=gen)
    q_out, k_out = apply_rotary(q, k, positions, rotary_cos_sin(ours, 256))
    hf = LlamaRotaryEmbedding(config)
    cos, sin = hf(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    assert torch.equal(q_out, q_hf[0].transpose(0, 1))
    assert torch.equal(k_out, k_hf[0].transpose(0, 1))


def test_rotation_is_complex_multiplication() -> None:
    gen = fresh_generator()
    inv_freq = rope_inv_freq({"rope_type": "default", "rope_theta": 10000.0}, 16, 100)
    positions = torch.tensor([0, 1, 7, 99])
    q = torch.randn(4, 3, 16, generator=gen)
    q_out, _ = apply_rotary(q, q[:, :1], positions, rotary_cos_sin(inv_freq, 100))
    angle = positions[:, None].double() * inv_freq.double()[None]  # [4, 8]
    z = torch.complex(q[..., :8].double(), q[..., 8:].double()) * torch.polar(
        torch.ones_like(angle), angle)[:, None, :]
    torch.testing.assert_close(q_out.double(), torch.cat([z.real, z.imag], -1), atol=1e-5,
                               rtol=1e-5)
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity
