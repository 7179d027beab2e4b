"""Rotary embedding: inverse frequencies equal transformers' per rope variant, rotation equals a
complex-number reference, and applying it matches transformers' apply_rotary_pos_emb exactly."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from shoal.kernels.rotary import (apply_rotary, rope_attention_factor, rope_inv_freq,
                                 rotary_cos_sin)

VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 1000000.0, "factor": 8.0, "beta_fast": 16.0,
     "beta_slow": 2.0, "mscale": 0.7, "mscale_all_dim": 1.0, "truncate": False,
     "original_max_position_embeddings": 32},
    {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
     "short_factor": [1.0 + 0.05 * i for i in range(16)],
     "long_factor": [1.0 + 0.9 * i for i in range(16)]},
]
ROPE_TYPES = ("linear", "dynamic", "llama3", "yarn", "longrope")


def _config(rope: dict) -> LlamaConfig:
    return LlamaConfig(hidden_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                       max_position_embeddings=256, rope_parameters=dict(rope))


@pytest.mark.parametrize("max_len", [256, 64])
@pytest.mark.parametrize("rope", VARIANTS, ids=lambda r: r["rope_type"])
def test_inv_freq_and_rotation_match_transformers(rope: dict, max_len: int) -> None:
    """max_len 64 = LongRoPE's original length: its short factors (positions below 64), else
    its long ones; cos and sin carry YaRN's and LongRoPE's attention factor."""
    config = _config(rope)
    ours = rope_inv_freq(rope, 32, 256, max_model_len=max_len)
    factor = rope_attention_factor(rope, 256)
    if rope["rope_type"] in ROPE_TYPES:
        theirs, their_factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](config, "cpu",
                                                                     seq_len=max_len)
        assert torch.equal(ours, theirs)
        assert factor == their_factor
        assert (factor != 1.0) == (rope["rope_type"] in ("yarn", "longrope"))
    gen = fresh_generator()
    positions = torch.randint(0, max_len, (9,), generator=gen)
    positions[0] = max_len - 1  # (transformers' LongRoPE picks its factors by the last position)
    q, k = torch.randn(9, 4, 32, generator=gen), torch.randn(9, 2, 32, generator=gen)
    cos_sin = rotary_cos_sin(ours, 256, factor)
    q_out, k_out = apply_rotary(q, k, positions, cos_sin)
    hf = LlamaRotaryEmbedding(config)
    cos, sin = hf(q, positions[None])
    assert torch.equal(cos_sin[positions, :16], cos[0, :, :16])
    assert torch.equal(cos_sin[positions, 16:], sin[0, :, :16])
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


def test_an_unknown_rope_type_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="'mrope' is not supported"):
        rope_inv_freq({"rope_type": "mrope", "rope_theta": 10000.0}, 32, 256)


def test_partial_rotary_rotates_the_first_part_of_each_head() -> None:
    """Phi-4-mini: partial_rotary_factor 0.75 rotates 24 of 32 dims, as transformers does."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply

    from shoal.kernels import TORCH_OPS
    from shoal.services.engine.layers.rotary import RotaryEmbedding, rope_parameters

    config = Phi3Config(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=256, partial_rotary_factor=0.75,
                        original_max_position_embeddings=64,
                        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                         "short_factor": [1.1] * 12, "long_factor": [3.0] * 12,
                                         "partial_rotary_factor": 0.75})
    rotary = RotaryEmbedding(rope_parameters(config), 32, 256, 256, TORCH_OPS)
    assert rotary.rotary_dim == 24
    gen = fresh_generator()
    positions = torch.tensor([255, 3, 70, 100])
    q, k = torch.randn(4, 4, 32, generator=gen), torch.randn(4, 2, 32, generator=gen)
    q_out, k_out = rotary(positions, q, k)
    cos, sin = Phi3RotaryEmbedding(config)(q, positions[None])
    q_hf, k_hf = phi3_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    torch.testing.assert_close(q_out, q_hf[0].transpose(0, 1), atol=1e-6, rtol=0)
    torch.testing.assert_close(k_out, k_hf[0].transpose(0, 1), atol=1e-6, rtol=0)
    assert torch.equal(q_out[..., 24:], q[..., 24:])
