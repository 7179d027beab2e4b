"""Models from GGUF files as llama.cpp writes them (tests/gguf_files.py): a tiny Qwen3-MoE and
Qwen2-MoE (shared expert) written as qwen3moe / qwen2moe with stacked `ffn_*_exps` experts, and a
Gemma 2 (soft-caps from the metadata, norms stored as 1 + w), a Gemma 3 (linear RoPE scaling
on its global layers) and a Phi-3 (fused q/k/v and gate/up, partial rotary, LongRoPE), loaded
by path as a user would (model_prep converts it), generate what transformers generates from the
original folder, greedy and logprobs; the converted weights equal the originals. Mixtral as
llama.cpp writes it (architecture "llama" with experts) is refused with a reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from shoal.services.engine.config import ConfigError
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path
from shoal.services.engine.sampling_params import SamplingParams
from tests.gguf_files import write_gguf
from tests.parity.parity_helpers import assert_greedy_close, assert_logprobs_close, hf_greedy
from tests.tiny_models import VOCAB, save_tiny_model

MAX_NEW = 12
GGUF_SHAPES = {"qwen3_moe": {"mlp_only_layers": []},  # llama.cpp: experts in every layer
               "qwen2_moe": {},
               "gemma2": {"query_pre_attn_scalar": 32},  # llama.cpp's: the head size
               "gemma3": {"query_pre_attn_scalar": 32, "num_hidden_layers": 6,  # its 5:1 layers
                          "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
               "phi3": {}}  # LongRoPE's factors as tensors, partial rotary
ENGINE = {"phi3": {"max_model_len": 64}}  # short factors, as transformers' for these lengths


@pytest.mark.parametrize("arch", list(GGUF_SHAPES))
def test_gguf_generates_as_transformers(arch: str, tmp_path: Path) -> None:
    folder = save_tiny_model(arch, tmp_path / "hf", seed=2, **GGUF_SHAPES[arch])
    gguf_file = write_gguf(folder, tmp_path / f"tiny-{arch}.gguf", smollm2_gguf_path())
    converted = prepare_model(str(gguf_file), cache_dir=tmp_path / "cache")
    assert json.loads((converted / "config.json").read_text())["architectures"] == \
        json.loads((folder / "config.json").read_text())["architectures"]
    original = load_file(folder / "model.safetensors")
    for name, tensor in load_file(converted / "model.safetensors").items():
        if ".experts." not in name:  # (stacked there; the logits below cover the experts)
            torch.testing.assert_close(tensor, original[name], msg=name)  # (Gemma: 1 + w - 1)

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19)]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    llm = LLM(str(gguf_file), device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              cache_dir=str(tmp_path / "cache"), **ENGINE.get(arch, {}))  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    try:
        for i, (out, ref) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), refs)):
            assert_greedy_close(out.outputs[0].token_ids, ref, f"{arch} prompt {i}")
            assert_logprobs_close(out.outputs[0].logprobs, ref, 2, f"{arch} prompt {i}")
    finally:
        llm.shutdown()


def test_mixtral_as_llama_gguf_is_refused(tmp_path: Path) -> None:
    folder = save_tiny_model("mixtral", tmp_path / "hf", seed=2)
    gguf_file = write_gguf(folder, tmp_path / "tiny-mixtral.gguf", smollm2_gguf_path())
    with pytest.raises(ConfigError, match="Mixtral as llama.cpp writes it"):
        prepare_model(str(gguf_file), cache_dir=tmp_path / "cache")
