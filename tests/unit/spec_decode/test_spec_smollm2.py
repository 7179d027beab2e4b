"""SmolLM2 (the real model): greedy output token-identical with and without speculation, n-gram
and layer_skip, on a batch mixing a copy-heavy prompt (many drafts accepted) with plain chat."""

from __future__ import annotations

import pytest

from shoal.services.engine import LLM, SamplingParams

TEXT = ("The quick brown fox jumps over the lazy dog. Shoal is an LLM serving system written in "
        "Python; it keeps its state in Postgres.")
CHATS = [[{"role": "user", "content": f"Repeat the following text exactly, word for word:\n\n"
                                      f"{TEXT}"}],
         [{"role": "user", "content": "What is the capital of France?"}],
         [{"role": "user", "content": "Give me two tips for learning a new language."}]]


@pytest.fixture(scope="module")
def folder() -> str:
    from tests.tiny_models import smollm2_dir

    try:
        return str(smollm2_dir())
    except Exception as exc:
        pytest.skip(f"SmolLM2 is not available: {exc}")


def test_smollm2_greedy_identity(folder: str) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=32)
    common = dict(max_model_len=512, kv_cache_memory=64 * 2**20)
    base = LLM(folder, **common).chat(CHATS, params, use_tqdm=False)
    for cfg in ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                 "prompt_lookup_max": 4},
                {"method": "layer_skip", "num_draft_layers": 10, "num_speculative_tokens": 2}):
        llm = LLM(folder, speculative_config=cfg, **common)
        spec = llm.chat(CHATS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in base]
        assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in base]
        stats = llm.engine.stats().spec_decode
        assert stats is not None and stats.num_accepted_tokens > 0, (cfg["method"], stats)
        bm = llm.engine.scheduler.block_manager
        assert bm.num_free_blocks == bm.pool.num_blocks
