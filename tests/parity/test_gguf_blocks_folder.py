"""A .gguf run as its own blocks starts from a folder without the Linear weights those blocks hold
(services/engine/gguf_folder.py): the folder is small, the engine generates what it generated
from the complete float32 conversion (same blocks, same dense tensors), and a blocks folder
loaded without blocks (a folder source: quantization none) dequantises the omitted weights from
the file and equals the complete folder. Quantised tiny families (Q8_0 / Q4_1 written by the gguf
package, tests/gguf_files.py) cover q/k's rotary row order, fused q/k/v and gate/up, Gemma's
norms and stacked experts beside block-stored attention; SmolLM2's Q4_1 file is the real one."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from safetensors import safe_open

from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.gguf_folder import OMITTED_FILE, omitted_weights
from shoal.services.engine.model_prep import default_cache_dir, prepare_model, smollm2_gguf_path
from shoal.services.engine.sampling_params import SamplingParams
from tests.gguf_files import write_gguf
from tests.parity.parity_helpers import assert_greedy_close, assert_logprobs_close, hf_greedy
from tests.tiny_models import VOCAB, save_tiny_model

MAX_NEW = 10
Q8_0 = gguf.GGMLQuantizationType.Q8_0
Q4_1 = gguf.GGMLQuantizationType.Q4_1
FAMILIES = {"qwen3_moe": ({"mlp_only_layers": []}, Q8_0),
            "gemma2": ({"query_pre_attn_scalar": 32}, Q8_0),
            "phi3": ({}, Q4_1)}
ENGINE = {"phi3": {"max_model_len": 64}}


def _generate(model: str, prompts: list[list[int]], cache: Path, **engine: object
              ) -> list[tuple[list[int], list]]:
    llm = LLM(model, device="cpu", dtype="float32", block_size=4, num_kv_blocks=64,
              cache_dir=str(cache), **engine)  # type: ignore[arg-type]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    try:
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs)
                for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.shutdown()


def _stored(folder: Path) -> set[str]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_quantised_family_runs_from_a_blocks_folder(arch: str, tmp_path: Path) -> None:
    shape, qtype = FAMILIES[arch]
    folder = save_tiny_model(arch, tmp_path / "hf", seed=2, **shape)
    gguf_file = write_gguf(folder, tmp_path / f"tiny-{arch}.gguf", smollm2_gguf_path(), qtype)
    cache = tmp_path / "cache"
    blocks = prepare_model(str(gguf_file), cache_dir=cache, gguf_blocks=True)
    full = prepare_model(str(gguf_file), cache_dir=cache)
    omitted = omitted_weights(blocks)
    assert omitted is not None and omitted_weights(full) is None
    assert any("q_proj" in n or "qkv_proj" in n for n in omitted.names)
    assert any("o_proj" in n for n in omitted.names)
    assert not omitted.names & _stored(blocks)  # left in the file, not written twice
    assert _stored(blocks) | omitted.names >= _stored(full) - {"lm_head.weight"}

    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17)]
    engine = ENGINE.get(arch, {})
    from transformers import AutoModelForCausalLM  # the file's dequantised weights

    hf = AutoModelForCausalLM.from_pretrained(full, dtype=torch.float32).eval()
    refs = [hf_greedy(hf, p, MAX_NEW) for p in prompts]
    outs = _generate(str(blocks), prompts, cache, **engine)  # dense, dequantised from the file
    for i, ((tokens, logprobs), ref) in enumerate(zip(outs, refs, strict=True)):
        assert_greedy_close(tokens, ref, f"{arch} prompt {i}")
        assert_logprobs_close(logprobs, ref, 2, f"{arch} prompt {i}")
    # the blocks (int8 activations at one row: not the dense reference's figures), exactly as
    # they ran from the complete folder
    _assert_same(_generate(str(gguf_file), prompts, cache, **engine),
                 _from_complete_folder(gguf_file, full, prompts, cache, **engine))


def _from_complete_folder(source: Path, full: Path, prompts: list[list[int]], cache: Path,
                          **engine: object) -> list[tuple[list[int], list]]:
    """quantization "gguf" as it ran before blocks folders: the complete float32 folder loaded,
    then the block layers checked against it."""
    from shoal.services.engine.config import EngineConfig
    from shoal.services.engine.frontend.tokenizer import load_tokenizer
    from shoal.services.engine.runner.model_runner import ModelRunner

    config = EngineConfig(model=str(source), device="cpu", dtype="float32", block_size=4,
                          num_kv_blocks=64, cache_dir=str(cache), **engine)  # type: ignore[arg-type]
    return _generate(str(source), prompts, cache, runner=ModelRunner(config, full),
                     tokenizer_obj=load_tokenizer(full), **engine)


@pytest.mark.slow
def test_smollm2_blocks_folder_equals_the_complete_conversion() -> None:
    source = smollm2_gguf_path()
    cache = default_cache_dir()  # (both folders shared with the other tests that convert it)
    blocks = prepare_model(str(source), cache_dir=cache, gguf_blocks=True)
    full = prepare_model(str(source), cache_dir=cache)
    size = (blocks / "model.safetensors").stat().st_size
    assert size < 0.4 * (full / "model.safetensors").stat().st_size  # the embedding, mostly
    assert json.loads((blocks / OMITTED_FILE).read_text())["gguf"] == str(source.resolve())
    prompts = [[1, 504, 3458, 282, 4649, 314, 253], [1, 9690, 28, 1345, 314]]
    _assert_same(_generate(str(source), prompts, cache),  # the engine's default: blocks folder
                 _from_complete_folder(source, full, prompts, cache))
    _assert_same(_generate(str(blocks), prompts, cache), _generate(str(full), prompts, cache))


def _assert_same(a: list[tuple[list[int], list]], b: list[tuple[list[int], list]]) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, steps_a), (_, steps_b) in zip(a, b, strict=True):
        for step_a, step_b in zip(steps_a, steps_b, strict=True):
            assert step_a.logprob == pytest.approx(step_b.logprob, abs=1e-5)
            assert [t for t, _ in step_a.top] == [t for t, _ in step_b.top]
            assert [lp for _, lp in step_a.top] == pytest.approx([lp for _, lp in step_b.top],
                                                                 abs=1e-5)
