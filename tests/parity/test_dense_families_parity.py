"""What the generic tiny parity runs (test_tiny_generate_parity.py) cannot show for Gemma 2,
Phi-3 and Granite: that their tiny configs exercise the feature (transformers' own tokens change
without it, so the parity there can fail), LongRoPE's long factors against transformers (a
prompt past the original 64 positions), Gemma 2's soft-capped attention on the plain-torch op
set as well as the C++ one; YaRN end to end on a tiny Qwen3; an unknown activation refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.seeding import fresh_generator
from transformers import AutoModelForCausalLM

from shoal.kernels import TORCH_OPS
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from tests.parity.parity_helpers import (Reference, assert_greedy_close, assert_logprobs_close,
                                         hf_greedy)
from tests.tiny_models import VOCAB, save_tiny_model, with_config

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)


def _prompts(*lens: int) -> list[list[int]]:
    gen = fresh_generator()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lens]


def _references(folder: Path, prompts: list[list[int]]) -> list[Reference]:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _check(llm: LLM, prompts: list[list[int]], refs: list[Reference]) -> None:
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, GREEDY, use_tqdm=False), refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 2, f"prompt {i}")


@pytest.mark.parametrize("arch, plain", [
    ("gemma2", {"attn_logit_softcapping": None, "final_logit_softcapping": None}),
    ("granite", {"embedding_multiplier": 1.0, "attention_multiplier": 0.125,
                 "residual_multiplier": 1.0, "logits_scaling": 1.0}),
])
def test_the_tiny_config_exercises_the_feature(arch: str, plain: dict,
                                               tmp_path: Path) -> None:
    folder = save_tiny_model(arch, tmp_path / arch, seed=1)
    prompts = _prompts(3, 30, 9)
    refs = _references(folder, prompts)
    without = _references(with_config(folder, tmp_path / "plain", **plain), prompts)
    assert any(r.token_ids != w.token_ids for r, w in zip(refs, without))


def test_phi3_long_rope_past_the_original_length(tmp_path: Path) -> None:
    """Prompts longer than the original 64 positions: transformers rotates the whole sequence
    with the long factors, as the engine does when max_model_len (512 here) passes 64."""
    folder = save_tiny_model("phi3", tmp_path / "phi3", seed=1)
    prompts = _prompts(70, 100)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=32)
    assert llm.engine.runner.max_model_len == 512
    _check(llm, prompts, _references(folder, prompts))


def test_gemma2_soft_capped_attention_on_the_torch_ops(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal.services.engine.runner.model_runner.select_ops",
                        lambda device: TORCH_OPS)
    folder = save_tiny_model("gemma2", tmp_path / "gemma2", seed=1)
    prompts = _prompts(3, 30, 9, 17)
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=8)
    assert llm.engine.runner.ops is TORCH_OPS
    _check(llm, prompts, _references(folder, prompts))


def test_yarn_rope_matches_transformers(tmp_path: Path) -> None:
    """A tiny Qwen3 with YaRN (factor 4 over 128 original positions): the ramped frequencies and
    the attention factor on cos/sin through the engine's rotary op; the context grows to 512."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 128}
    full = save_tiny_model("qwen3", tmp_path / "qwen3", seed=1)
    folder = with_config(full, tmp_path / "yarn", rope_parameters=yarn)
    prompts = _prompts(3, 30, 9)
    refs = _references(folder, prompts)
    assert any(r.token_ids != d.token_ids for r, d in zip(refs, _references(full, prompts)))
    llm = LLM(str(folder), device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=8)
    assert llm.engine.runner.max_model_len == 512
    _check(llm, prompts, refs)


def test_an_unsupported_activation_is_refused() -> None:
    from types import SimpleNamespace

    from shoal.services.engine.config import ConfigError
    from shoal.services.engine.layers.activation import GeluAndMul, gated_activation

    assert isinstance(gated_activation(SimpleNamespace(hidden_activation="gelu_pytorch_tanh",
                                                       hidden_act="gelu")), GeluAndMul)
    with pytest.raises(ConfigError, match="'relu2' is not supported"):
        gated_activation(SimpleNamespace(hidden_act="relu2"))
