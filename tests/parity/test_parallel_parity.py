"""Tensor and pipeline parallel engines (ranks as processes, gloo) against the same engine at
TP=1: greedy tokens identical, logprobs (sampled, top-2 and prompt) within 1e-4, a seeded
sampled request identical, over mixed prompts prefilled in chunks. One parallel shape per tiny
family (TP=2 with split KV heads, TP=2 with a replicated KV head, PP=2 with a tied LM head on the
last stage, TP=2 x PP=2; the MoE families: TP=2 with every expert split, PP=2; OLMoE's
whole-projection q/k norms at TP=2; Gemma 2 at TP=2 x PP=2, Gemma 3 at TP=2 with a replicated
KV head, Phi-3 at TP=2 (its fused qkv and gate_up tensors cut per rank), Granite at PP=2) and
SmolLM2 at TP=3 and at PP=2 (TP=2 refused before any rank starts). Killing a rank fails the
next step with the rank named."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

from shoal.services.engine.config import ConfigError
from shoal.services.engine.distributed.executor import RankFailed
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.core.request_output import RequestOutput
from shoal.services.engine.sampling_params import SamplingParams
from tests.tiny_models import MOE_ARCHS, VOCAB, save_tiny_model, smollm2_dir

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=128,
              max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2,
                        prompt_logprobs=1)
SEEDED = SamplingParams(temperature=0.9, max_tokens=6, ignore_eos=True, seed=7, logprobs=1)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 21, 9)]


def _run(folder: Path, prompts: list, **engine: object) -> tuple[list[RequestOutput], LLM]:
    llm = LLM(str(folder), **ENGINE, **engine)  # type: ignore[arg-type]
    params = [GREEDY] * len(prompts) + [SEEDED]
    return llm.generate(prompts + prompts[:1], params, use_tqdm=False), llm


def _assert_same(ours: list[RequestOutput], ref: list[RequestOutput]) -> None:
    for a, b in zip(ours, ref, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for x, y in zip(a.outputs[0].logprobs or [], b.outputs[0].logprobs or [], strict=True):
            assert abs(x.logprob - y.logprob) <= 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(u - v) <= 1e-4 for (_, u), (_, v) in zip(x.top, y.top))
        for x, y in zip(a.prompt_logprobs or [], b.prompt_logprobs or [], strict=True):
            assert (x is None) == (y is None)
            if x is not None and y is not None:
                assert x.token_id == y.token_id and abs(x.logprob - y.logprob) <= 1e-4


@pytest.mark.parametrize("arch, tp, pp", [("llama", 2, 1), ("mistral", 2, 1), ("qwen2", 1, 2),
                                          ("qwen3", 2, 2), ("qwen3_moe", 2, 1),
                                          ("qwen2_moe", 2, 1), ("mixtral", 1, 2),
                                          ("olmoe", 2, 1), ("gpt_oss", 2, 1), ("gpt_oss", 1, 2),
                                          ("gemma2", 2, 2), ("gemma3", 2, 1),
                                          ("phi3", 2, 1), ("granite", 1, 2)])
def test_parallel_matches_one_rank(arch: str, tp: int, pp: int,
                                   tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = save_tiny_model(arch, tmp_path_factory.mktemp(arch), seed=1)
    prompts = _prompts()
    ref, _ = _run(folder, prompts)
    ours, llm = _run(folder, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        _assert_same(ours, ref)
        model = llm.engine.runner.runner.model  # rank 0's shard, in this process
        if tp > 1:  # sharded, not replicated: half the heads and half the vocabulary rows
            attn = model.model.layers[0].self_attn
            assert attn.num_heads == 2 and model.model.embed_tokens.weight.shape[0] == VOCAB // 2
            if arch in MOE_ARCHS:  # every expert's intermediate size split, as the MLP's
                experts = model.model.layers[0].mlp.experts
                assert experts.inter == experts.inter_total // 2
        if pp > 1:  # the first stage holds the first layer only, no LM head
            assert model.lm_head is None and isinstance(model.model.layers[1], torch.nn.Identity)
        if arch == "llama":  # a rank that dies fails the next step, naming it
            os.kill(llm.engine.runner.procs[1].pid, signal.SIGKILL)
            llm.engine.runner.procs[1].wait()
            with pytest.raises(RankFailed, match="rank 1 exited with code -9"):
                llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()
    assert all(p.poll() is not None for p in llm.engine.runner.procs.values())


def test_smollm2_tensor_parallel_three_and_two_stages() -> None:
    folder = smollm2_dir()
    with pytest.raises(ConfigError, match="tensor_parallel_size=2 cannot split"):
        LLM(str(folder), tensor_parallel_size=2)
    prompts = ["The capital of France is", "def fib(n):"]
    engine = dict(device="cpu", dtype="float32", kv_cache_memory=1 << 26)
    params = SamplingParams(temperature=0.0, max_tokens=6, logprobs=1)
    ref = LLM(str(folder), **engine).generate(prompts, params, use_tqdm=False)  # type: ignore[arg-type]
    for shape in ({"tensor_parallel_size": 3}, {"pipeline_parallel_size": 2}):
        with LLM(str(folder), **shape, **engine) as llm:  # type: ignore[arg-type]
            ours = llm.generate(prompts, params, use_tqdm=False)
        _assert_same(ours, ref)
        assert "Paris" in ours[0].outputs[0].text
