"""Which layers get a sliding window, per architecture, as transformers decides it; the window
reaches each Attention layer; max_model_len is no longer capped at the window."""

from __future__ import annotations

import pytest
import torch
from transformers import (AutoModelForCausalLM, LlamaConfig, MistralConfig, PretrainedConfig,
                          Qwen2Config, Qwen3Config)

from shoal.kernels import TORCH_OPS
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.model_runner import _max_model_len
from shoal.services.engine.models.registry import model_class

TINY = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2,
            num_key_value_heads=1, max_position_embeddings=256)


def _windows(cfg: PretrainedConfig) -> list[int | None]:
    return model_class(cfg).sliding_windows(cfg)


def test_mistral_windows_every_layer_when_set() -> None:
    cfg = MistralConfig(**TINY, num_hidden_layers=3, sliding_window=4096,
                        architectures=["MistralForCausalLM"])
    assert _windows(cfg) == [4096] * 3  # Mistral-7B-v0.1
    cfg = MistralConfig(**TINY, num_hidden_layers=3, sliding_window=None,
                        architectures=["MistralForCausalLM"])
    assert _windows(cfg) == [None] * 3  # v0.2 and later


def test_llama_ignores_a_stray_window() -> None:
    cfg = LlamaConfig(**TINY, num_hidden_layers=2, architectures=["LlamaForCausalLM"])
    cfg.sliding_window = 16  # transformers' LlamaModel never applies it
    assert _windows(cfg) == [None, None]


@pytest.mark.parametrize("config_class,arch", [(Qwen2Config, "Qwen2ForCausalLM"),
                                               (Qwen3Config, "Qwen3ForCausalLM")])
@pytest.mark.parametrize("use_sliding_window", [False, True])
@pytest.mark.parametrize("max_window_layers", [0, 2, 5])
def test_qwen_layers_match_transformers(config_class: type[PretrainedConfig], arch: str,
                                        use_sliding_window: bool, max_window_layers: int) -> None:
    cfg = config_class(**TINY, num_hidden_layers=4, sliding_window=12,
                       use_sliding_window=use_sliding_window, max_window_layers=max_window_layers,
                       architectures=[arch])
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    expected = [layer.self_attn.sliding_window for layer in hf.model.layers]
    assert _windows(cfg) == expected
    if use_sliding_window and max_window_layers < 4:
        assert 12 in expected  # the case is not vacuous


def test_qwen2_explicit_layer_types() -> None:
    cfg = Qwen2Config(**TINY, num_hidden_layers=3, sliding_window=8, use_sliding_window=True,
                      layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                      architectures=["Qwen2ForCausalLM"])
    assert _windows(cfg) == [8, None, 8]


def test_window_reaches_each_attention_layer() -> None:
    cfg = Qwen2Config(**TINY, num_hidden_layers=3, sliding_window=8, use_sliding_window=True,
                      max_window_layers=1, architectures=["Qwen2ForCausalLM"])
    model = model_class(cfg)(cfg, 256, TORCH_OPS)
    assert [layer.self_attn.attn.sliding_window for layer in model.model.layers] == [None, 8, 8]


def test_max_model_len_is_the_models_full_length() -> None:
    cfg = MistralConfig(**TINY, num_hidden_layers=1, sliding_window=16)
    assert _max_model_len(EngineConfig(model="m"), cfg) == 256  # not 16
    assert _max_model_len(EngineConfig(model="m", max_model_len=100), cfg) == 100


@pytest.mark.parametrize("arch", ["Gemma2ForCausalLM", "Gemma3ForCausalLM"])
def test_gemma_alternating_layers_match_transformers(arch: str) -> None:
    """Gemma 2: every other layer from the first; Gemma 3: five sliding layers to one full
    (its default layer_types), each as transformers' attention modules hold them."""
    from transformers import Gemma2Config, Gemma3TextConfig

    config_class = Gemma2Config if arch == "Gemma2ForCausalLM" else Gemma3TextConfig
    cfg = config_class(**TINY, num_hidden_layers=7, head_dim=8, sliding_window=12,
                       architectures=[arch])
    hf = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    expected = [layer.self_attn.sliding_window for layer in hf.model.layers]
    assert _windows(cfg) == expected
    assert None in expected and 12 in expected
