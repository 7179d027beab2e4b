"""A request resumed from part of its output (the gateway's mid-stream failover, issue 32) on the
real SmolLM2: it ends exactly as the undisturbed request, greedy or seeded, with max_tokens
counted over the whole output and a stop string that spans the seam found."""

from __future__ import annotations

import pytest

from shoal.services.engine.core.request_output import RequestOutput
from shoal.services.engine.core.request_state import Resumed
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest

pytestmark = pytest.mark.slow
PROMPT = "Once upon a time, there was a"


@pytest.fixture(scope="module")
def llm(gguf):
    """fp32 weights: prefill and decode compute alike, so even a seeded resume is exact (with
    the GGUF's own blocks, prefill's bf16 GEMM and decode's block matmul differ in the last
    bits, which can flip a sample that lands near a boundary; greedy holds, below)."""
    from shoal.services.engine.frontend.llm import LLM

    return LLM(gguf, device="cpu", dtype="float32", num_kv_blocks=128, num_threads=1,
               quantization="none")


def run(llm, params: SamplingParams, resume: Resumed | None = None) -> RequestOutput:
    ids = llm.engine.tokenizer.encode(PROMPT)
    rid = f"r{id(params)}-{resume is not None}"
    llm.engine.add_request(rid, ids, params, resume=resume)
    return llm._run([rid], use_tqdm=False)[0]


def resumed_from(llm, whole: RequestOutput, k: int) -> Resumed:
    ids = whole.outputs[0].token_ids[:k]
    return Resumed(tuple(ids), llm.engine.tokenizer.decode(ids))


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=30, ignore_eos=True,
                   presence_penalty=0.5, logprobs=2),
], ids=["greedy", "seeded"])
def test_resumed_output_equals_the_undisturbed_one(llm, params) -> None:
    whole = run(llm, params)
    assert len(whole.outputs[0].token_ids) == 30
    for k in (1, 13, 29):
        out = run(llm, params, resumed_from(llm, whole, k)).outputs[0]
        assert out.token_ids == whole.outputs[0].token_ids, k  # max_tokens counts the resumed
        assert out.text == whole.outputs[0].text and out.finish_reason == "length"
        if params.logprobs:  # the new tokens' logprobs are the undisturbed run's
            assert [lp.token_id for lp in out.logprobs[k:]] == out.token_ids[k:]


def test_a_stop_string_across_the_seam_is_found(llm) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    whole = run(llm, greedy)
    k = 10
    seam = len(llm.engine.tokenizer.decode(whole.outputs[0].token_ids[:k]))
    text = whole.outputs[0].text
    stop = text[seam - 3:seam + 3]  # begins in the resumed text, ends in the new
    stopping = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=[stop])
    undisturbed = run(llm, stopping).outputs[0]
    out = run(llm, stopping, resumed_from(llm, whole, k)).outputs[0]
    assert (out.text, out.finish_reason, out.stop_reason) == (
        undisturbed.text, "stop", stop) and out.text == text[:text.index(stop)]


def test_what_cannot_be_resumed_is_refused(llm) -> None:
    ids = llm.engine.tokenizer.encode(PROMPT)
    with pytest.raises(InvalidRequest, match="n = 1"):
        llm.engine.process("x", ids, SamplingParams(n=2), resume=Resumed((1, 2)))
    with pytest.raises(InvalidRequest, match="token ids"):
        llm.engine.process("x", ids, SamplingParams(), resume=Resumed((10**7,)))


def test_a_greedy_resume_on_the_gguf_blocks(gguf) -> None:
    """On the file's own blocks a step of many rows (bf16 GEMM) and a decode step (int8
    activations) round differently, so a resume need not equal the undisturbed run bit for bit
    past a near-tie (as vLLM's prefill and decode need not either): it must continue exactly as
    a fresh request over the same tokens (the prompt and the k resumed ones) does."""
    from shoal.services.engine.frontend.llm import LLM

    blocks = LLM(gguf, device="cpu", num_kv_blocks=128, num_threads=1)  # the default: "gguf"
    greedy = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    undisturbed = run(blocks, greedy)
    whole = undisturbed.outputs[0].token_ids
    k = 13
    out = run(blocks, greedy, resumed_from(blocks, undisturbed, k)).outputs[0]
    ids = blocks.engine.tokenizer.encode(PROMPT) + list(whole[:k])
    blocks.engine.add_request("fresh", ids, SamplingParams(temperature=0, max_tokens=30 - k,
                                                           ignore_eos=True))
    fresh = blocks._run(["fresh"], use_tqdm=False)[0].outputs[0].token_ids
    assert len(out.token_ids) == 30 and out.finish_reason == "length"
    assert list(out.token_ids[:k]) == list(whole[:k])
    assert list(out.token_ids[k:]) == list(fresh)
