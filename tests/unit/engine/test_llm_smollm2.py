"""The engine core end to end on the real SmolLM2-135M (GGUF, converted once and cached):
the chat answer, and greedy tokens unchanged by batching, prefix-cache hits and preemption."""

from __future__ import annotations

import pytest

from shoal.services.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, there was a"]


@pytest.fixture(scope="module")
def llm(gguf):
    from shoal.services.engine.frontend.llm import LLM

    return LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=64,
               num_threads=1)


def test_chat_answers_paris(llm):
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=20), use_tqdm=False)[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"


def test_greedy_tokens_do_not_depend_on_batching_or_the_prefix_cache(llm):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [llm.generate(p, greedy, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS]
    hits_before = llm.engine.stats().prefix_cache_hits
    batched = llm.generate(PROMPTS, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in batched] == alone
    long_prompt = " ".join(PROMPTS) * 3  # > 1 block: the repeat is served from the cache
    first = llm.generate(long_prompt, greedy, use_tqdm=False)[0]
    again = llm.generate(long_prompt, greedy, use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and llm.engine.stats().prefix_cache_hits > hits_before
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_preemption_under_a_tiny_pool_keeps_greedy_tokens(gguf):
    """Dense fp32 weights (quantization "none") on both sides: a preempted sequence's recompute
    is a many-row prefill, and the quantised kernels' many-row path (bf16 / int8 activations)
    moves logits by ~0.06 against their one-row path, enough to flip a near-tie on an AMX
    Xeon (the file's blocks: a 0.06-nat tie at token 25); the scheduler is what is tested."""
    from shoal.services.engine.frontend.llm import LLM

    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    roomy = LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128, num_threads=1,
                quantization="none")
    expected = [o.outputs[0].token_ids for o in roomy.generate(PROMPTS, greedy, use_tqdm=False)]
    roomy.shutdown()
    tiny = LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=4, block_size=16,
               enable_prefix_caching=False, num_threads=1, quantization="none")
    outputs = tiny.generate(PROMPTS, greedy, use_tqdm=False)
    assert tiny.engine.stats().num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outputs] == expected
