"""LLM.generate against transformers' greedy generate for each tiny architecture: a batch of
mixed-length prompts, again under a KV pool small enough to preempt, again with prompts split
by a small token budget (chunked prefill); logprobs and prompt logprobs to 1e-4; a repeated
long prompt is served from the prefix cache with the same output."""

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
from tests.tiny_models import ARCHS, VOCAB, engine_args, save_tiny_model

MAX_NEW = 16
PROMPT_LENS = [3, 30, 9, 17, 1, 12]
ENGINES = {
    "roomy": dict(block_size=4, num_kv_blocks=256),
    "preempting": dict(block_size=4, num_kv_blocks=14, enable_prefix_caching=False),
    "chunked": dict(block_size=4, num_kv_blocks=256, max_num_batched_tokens=8, max_num_seqs=3),
}


@pytest.fixture(scope="module", params=ARCHS)
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, list[list[int]], list[Reference]]:
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param), seed=1)
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _ENGINE_ARGS[folder] = engine_args(request.param)
    return folder, prompts, [hf_greedy(hf, p, MAX_NEW) for p in prompts]


_ENGINE_ARGS: dict[Path, dict[str, int]] = {}
"""Per tiny folder: the family's own engine settings (tiny_models.ENGINE_ARGS)."""


def _llm(folder: Path, **engine: int | bool) -> LLM:
    return LLM(str(folder), device="cpu", dtype="float32",  # type: ignore[arg-type]
               **_ENGINE_ARGS.get(folder, {}), **engine)


@pytest.mark.parametrize("engine", list(ENGINES))
def test_greedy_generate_matches_transformers(tiny: tuple, engine: str) -> None:
    folder, prompts, refs = tiny
    llm = _llm(folder, **ENGINES[engine])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outputs, refs)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"{engine} prompt {i}")
    if engine == "preempting":
        assert llm.engine.stats().num_preemptions > 0


def test_logprobs_and_prompt_logprobs_match(tiny: tuple) -> None:
    folder, prompts, refs = tiny
    llm = _llm(folder, **ENGINES["chunked"])  # prompt logprobs across chunks too
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=3,
                            prompt_logprobs=2)
    for i, (out, ref) in enumerate(zip(llm.generate(prompts, params, use_tqdm=False), refs)):
        # the logprob check stops at the first flip: the tokens are checked on their own
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 3, f"prompt {i}")
        plp = out.prompt_logprobs
        assert plp is not None and len(plp) == len(prompts[i]) and plp[0] is None
        for pos, entry in enumerate(plp[1:]):
            target = prompts[i][pos + 1]
            assert entry.token_id == target
            assert abs(entry.logprob - float(ref.prompt_logprobs[pos, target])) <= 1e-4
            assert len(entry.top) == 2


def test_repeated_long_prompt_hits_the_prefix_cache(tiny: tuple) -> None:
    folder, prompts, refs = tiny
    llm = _llm(folder, **ENGINES["roomy"])
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    first = llm.generate(prompts[1], params, use_tqdm=False)[0]
    again = llm.generate(prompts[1], params, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens >= 24
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_greedy_close(again.outputs[0].token_ids, refs[1], "cached")
