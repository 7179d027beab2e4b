"""Speculative decoding inside the engine, on a tiny random Llama (SmolLM2's tokenizer): greedy
output is token-identical with and without speculation across mixed batches, chunked prefill,
preemption, prefix-cache hits, n > 1, penalties, min_tokens, stop strings and logprobs
(which run without speculation), and every KV block is back in the pool afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from shoal.services.engine import LLM, SamplingParams
from shoal.services.engine.core.request_output import RequestOutput
from tests.tiny_models import save_tiny_model

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
         "prompt_lookup_max": 3}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("spec-llama"), seed=3)


def _pair(folder: Path, **cfg: Any) -> tuple[LLM, LLM]:
    base = LLM(str(folder), block_size=4, **cfg)
    return base, LLM(str(folder), block_size=4, speculative_config=NGRAM, **cfg)


def _prompts() -> list[list[int]]:
    return [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8] * 2, [20, 21, 22, 23] * 4, list(range(30, 61)),
            [100, 101] * 3, [7] * 9 + [8, 9]]


def _same(a: list[RequestOutput], b: list[RequestOutput]) -> None:
    for x, y in zip(a, b, strict=True):
        assert [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in x.outputs] == \
            [(c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in y.outputs]


def _assert_pool_free(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.pool.num_blocks
    assert all(b.ref_count == 0 for b in bm.pool.blocks)


def test_greedy_identity_in_mixed_batches_with_chunking_and_preemption(folder: Path) -> None:
    """A small pool forces preemption, a small token budget chunks the prompts while others
    decode with drafts; requests with logprobs (no speculation), penalties, min_tokens and n = 2
    share the batch with plain ones."""
    base, spec = _pair(folder, num_kv_blocks=24, max_num_batched_tokens=16)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    params = [plain, SamplingParams(temperature=0.0, max_tokens=30, logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=35, repetition_penalty=1.3,
                             presence_penalty=0.5, frequency_penalty=0.3),
              SamplingParams(temperature=0.0, max_tokens=25, min_tokens=20, n=2),
              SamplingParams(temperature=0.0, max_tokens=33, stop_token_ids=[134, 226])]
    a = base.generate(_prompts(), params, use_tqdm=False)
    b = spec.generate(_prompts(), params, use_tqdm=False)
    _same(a, b)
    # the same tokens, ranks and top-N; the values to float rounding: a step's matmul kernel
    # depends on its row count (up to 32 rows: the CPU panels, more: oneDNN), and drafts add rows
    for x, y in zip(a[1].outputs[0].logprobs, b[1].outputs[0].logprobs, strict=True):
        assert (x.token_id, x.rank, [t for t, _ in x.top]) == (y.token_id, y.rank,
                                                                [t for t, _ in y.top])
        assert x.logprob == pytest.approx(y.logprob, abs=1e-5)
        assert [v for _, v in x.top] == pytest.approx([v for _, v in y.top], abs=1e-5)
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and base.engine.stats().num_preemptions > 0
    assert stats.spec_decode is not None and stats.spec_decode.num_accepted_tokens > 0
    assert stats.generation_tokens == base.engine.stats().generation_tokens
    _assert_pool_free(spec)


def test_greedy_identity_with_prefix_hits_and_stop_strings(folder: Path) -> None:
    base, spec = _pair(folder, num_kv_blocks=128)
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    first = base.generate(_prompts(), plain, use_tqdm=False)
    _same(first, spec.generate(_prompts(), plain, use_tqdm=False))
    # the same prompts again: served from the prefix cache, with stop strings cut from the
    # middle of the first answers (speculation may have accepted tokens past them)
    stops = [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                            stop=[o.outputs[0].text[12:15]]) for o in first]
    hits = spec.engine.stats().prefix_cache_hits
    _same(base.generate(_prompts(), stops, use_tqdm=False),
          spec.generate(_prompts(), stops, use_tqdm=False))
    assert spec.engine.stats().prefix_cache_hits > hits
    _assert_pool_free(spec)


def test_switched_off_at_batch_size_and_sampling_runs(folder: Path) -> None:
    """disable_by_batch_size=1: never a draft. Random sampling with drafts gives well-formed
    outputs of the asked length and a seeded request repeats itself."""
    off = LLM(str(folder), block_size=4, speculative_config={**NGRAM, "disable_by_batch_size": 1})
    plain = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    off.generate(_prompts(), plain, use_tqdm=False)
    assert off.engine.stats().spec_decode.num_drafts == 0
    spec = LLM(str(folder), block_size=4, speculative_config=NGRAM)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=30, seed=11, ignore_eos=True)
    a = spec.generate(_prompts(), seeded, use_tqdm=False)
    b = spec.generate(_prompts(), seeded, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]
    assert all(len(o.outputs[0].token_ids) == 30 for o in a)
    assert spec.engine.stats().spec_decode.num_drafts > 0
    _assert_pool_free(spec)


@pytest.mark.parametrize("method", ["layer_skip", "draft_model"])
def test_draft_proposers_keep_greedy_output_under_preemption(folder: Path, method: str) -> None:
    """The target's first layer as the draft, and a separate draft model (the same checkpoint
    loaded again, with its own KV cache): output identical to no speculation with a pool small
    enough to preempt. The self draft agrees with the target, so (nearly) every draft must be
    accepted: a draft KV cache left stale by preemption, prefix hits or rejections would not be."""
    cfg = ({"method": "layer_skip", "num_draft_layers": 1, "num_speculative_tokens": 3}
           if method == "layer_skip" else
           {"method": "draft_model", "model": str(folder), "num_speculative_tokens": 3})
    plain = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    base = LLM(str(folder), block_size=4, num_kv_blocks=24, max_num_batched_tokens=16)
    spec = LLM(str(folder), block_size=4, num_kv_blocks=24, max_num_batched_tokens=16,
               speculative_config=cfg)
    for _ in range(2):  # the second round starts from prefix-cache hits
        _same(base.generate(_prompts(), plain, use_tqdm=False),
              spec.generate(_prompts(), plain, use_tqdm=False))
    stats = spec.engine.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert stats.spec_decode.num_draft_tokens > 0
    if method == "draft_model":
        assert stats.spec_decode.acceptance_rate >= 0.95
    _assert_pool_free(spec)
