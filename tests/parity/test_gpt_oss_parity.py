"""What the generic tiny runs (test_tiny_generate_parity.py, test_parallel_parity.py) cannot show
for gpt-oss: that its tiny config exercises the sinks, the sliding window and the SwiGLU clamp
(transformers' own tokens change without each, so the parity there can fail); an MXFP4
checkpoint as OpenAI ships it (blocks and scales written by tests/tiny_models.py, read by
transformers' own mxfp4 dequantisation for the reference) served with the same tokens and
logprobs, at TP=2 too; the sinks on the plain-torch op set as well as the C++ one.

The real tokenizer (o200k_harmony, which transformers builds through tiktoken) is not available
offline: these runs use token ids over SmolLM2's tokenizer files, as every tiny model does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Mxfp4Config

from shoal.kernels import TORCH_OPS
from shoal.services.engine.config import ConfigError
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from tests.parity.parity_helpers import (Reference, assert_greedy_close, assert_logprobs_close,
                                         hf_greedy)
from tests.seeding import fresh_generator
from tests.tiny_models import VOCAB, save_gpt_oss_mxfp4, save_tiny_model, with_config

MAX_NEW = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=8)


def _prompts() -> list[list[int]]:
    gen = fresh_generator()
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 30, 9)]


def _references(folder: Path, prompts: list[list[int]], **load: object) -> list[Reference]:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **load).eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _check(llm: LLM, prompts: list[list[int]], refs: list[Reference]) -> None:
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, GREEDY, use_tqdm=False), refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 2, f"prompt {i}")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("gpt_oss", tmp_path_factory.mktemp("gpt_oss"), seed=1)


def test_the_tiny_config_exercises_each_feature(tiny: Path, tmp_path: Path) -> None:
    prompts = _prompts()
    refs = _references(tiny, prompts)
    no_sinks = with_config(tiny, tmp_path / "no_sinks")
    tensors = load_file(no_sinks / "model.safetensors")
    for name in tensors:
        if name.endswith("sinks"):  # exp(-1e4) is 0: no sink in any softmax
            tensors[name] = torch.full_like(tensors[name], -1e4)
    save_file(tensors, no_sinks / "model.safetensors", metadata={"format": "pt"})
    variants = {"sinks": no_sinks,
                "window": with_config(tiny, tmp_path / "no_window", sliding_window=4096),
                "clamp": with_config(tiny, tmp_path / "no_clamp", swiglu_limit=1000.0)}
    for feature, folder in variants.items():
        without = _references(folder, prompts)
        assert any(r.token_ids != w.token_ids for r, w in zip(refs, without)), feature


def test_an_mxfp4_checkpoint_as_openai_ships_it(tiny: Path, tmp_path: Path) -> None:
    """Experts as `_blocks` / `_scales`, dequantised at load: transformers (its mxfp4
    integration, dequantising on the CPU) is the reference, at TP=1 and TP=2."""
    dense, packed = save_gpt_oss_mxfp4(tiny, tmp_path / "dense", tmp_path / "mxfp4")
    prompts = _prompts()
    refs = _references(packed, prompts, quantization_config=Mxfp4Config(dequantize=True))
    assert [r.token_ids for r in refs] == [r.token_ids for r in _references(dense, prompts)]
    _check(LLM(str(packed), **ENGINE), prompts, refs)  # type: ignore[arg-type]
    with LLM(str(packed), tensor_parallel_size=2, **ENGINE) as llm:  # type: ignore[arg-type]
        _check(llm, prompts, refs)
    tensors = load_file(packed / "model.safetensors")  # a pair cut in half is refused
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, packed / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ConfigError, match=r"layers.1.mlp.experts lacks \['down_proj_scales'\]"):
        LLM(str(packed), **ENGINE)  # type: ignore[arg-type]


def test_sinks_on_the_torch_ops(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("shoal.services.engine.runner.model_runner.select_ops",
                        lambda device: TORCH_OPS)
    prompts = _prompts()
    llm = LLM(str(tiny), **ENGINE)  # type: ignore[arg-type]
    assert llm.engine.runner.ops is TORCH_OPS
    _check(llm, prompts, _references(tiny, prompts))
