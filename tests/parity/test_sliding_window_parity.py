"""Sliding-window attention against transformers, greedy, token for token: a tiny Mistral (every
layer windowed), a tiny Qwen2 with `use_sliding_window` (only layers >= max_window_layers) and
tiny Gemma 2 and 3 (alternating: the "sliding_attention" layers),
with windows much shorter than prompt + generation. Mixed-length batches, chunked prefill,
preemption, logprobs, and a prompt extending a cached prefix past the window.

Each case first checks that the window changes transformers' own tokens for these prompts, so
a pass here means the engine applied the window (it fails when the window is ignored)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.seeding import fresh_generator
from transformers import AutoModelForCausalLM

from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from tests.parity.parity_helpers import (Reference, assert_greedy_close, assert_logprobs_close,
                                         hf_greedy)
from tests.tiny_models import VOCAB, save_tiny_model, with_config

MAX_NEW = 24
PROMPT_LENS = [3, 30, 9, 21, 1, 14]
# window 7: odd, never block-aligned (blocks of 4); window 10: Qwen2's second layer only
WINDOWED = {
    "mistral": {"sliding_window": 7},
    "qwen2": {"sliding_window": 10, "use_sliding_window": True, "max_window_layers": 1,
              "layer_types": ["full_attention", "sliding_attention"]},
    # Gemma: the first layer only ("sliding_attention"); Gemma 2's soft-capped kernels too
    "gemma2": {"sliding_window": 7},
    "gemma3": {"sliding_window": 5},
}
ENGINES = {
    "roomy": dict(block_size=4, num_kv_blocks=256),
    "preempting": dict(block_size=4, num_kv_blocks=16, enable_prefix_caching=False),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=3),
}
Case = tuple[Path, list[list[int]], list[Reference]]


def _references(folder: Path, prompts: list[list[int]]) -> list[Reference]:
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy(hf, p, MAX_NEW) for p in prompts]


@pytest.fixture(scope="module", params=list(WINDOWED))
def windowed(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    arch = request.param
    full = save_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=1)
    folder = with_config(full, tmp_path_factory.mktemp(arch) / "windowed", **WINDOWED[arch])
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    refs = _references(folder, prompts)
    unwindowed = _references(full, prompts)
    # the test can fail: the window changes transformers' own greedy tokens for these prompts
    assert any(r.token_ids != u.token_ids for r, u in zip(refs, unwindowed))
    return folder, prompts, refs


def _llm(folder: Path, **engine: int | bool) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", **engine)  # type: ignore[arg-type]


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_past_the_window_matches_transformers(windowed: Case, engine: str) -> None:
    folder, prompts, refs = windowed
    llm = _llm(folder, **ENGINES[engine])
    # the model's length, not the window: 512 positions (Qwen2's linear rope factor 2 doubles
    # them, as vLLM derives max_model_len)
    length = 1024 if "qwen2" in folder.parent.name else 512
    assert llm.engine.runner.max_model_len == length
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"{engine} prompt {i}")
    if engine == "preempting":
        assert llm.engine.stats().num_preemptions > 0


def test_logprobs_past_the_window_match(windowed: Case) -> None:
    folder, prompts, refs = windowed
    llm = _llm(folder, **ENGINES["chunked"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 2, f"prompt {i}")


def test_prompt_extending_a_cached_prefix(windowed: Case) -> None:
    """Blocks before the window stay cached and reusable: a longer prompt over a cached one."""
    folder, prompts, refs = windowed
    llm = _llm(folder, block_size=4, num_kv_blocks=256, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert_greedy_close(first.outputs[0].token_ids, refs[1], "first")
    longer = prompts[1] + prompts[3]
    again = llm.generate(longer, params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 28
    assert_greedy_close(again.outputs[0].token_ids, _references(folder, [longer])[0], "cached")
