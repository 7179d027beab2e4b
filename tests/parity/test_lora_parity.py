"""Batched multi-LoRA against PEFT: one engine batch mixing three random adapters and the base
model ([A, B, base, A, C]) gives each prompt the greedy tokens PEFT gives with its adapter
applied alone (and merged with merge_and_unload), logprobs to 1e-4; again with max_loras=1
(the scheduler runs one adapter at a time, and no step ever holds more); again at TP=2; and
on SmolLM2 with two adapters and the base model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shoal.services.engine import LLM, LoRARequest, SamplingParams
from tests.lora_adapters import ALL_TARGETS, peft_model, save_adapter
from tests.parity.parity_helpers import (Reference, assert_greedy_close, assert_logprobs_close,
                                         hf_greedy)
from tests.seeding import fresh_generator
from tests.tiny_models import VOCAB, save_tiny_model

MAX_NEW = 10
ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=256,
              max_num_batched_tokens=16, enable_lora=True, max_lora_rank=16)
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, list, list]:
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model("llama", root / "base", seed=1)
    adapters = {  # every target, q/v only with another rank, and o + MLP with rsLoRA
        "A": save_adapter(base, root / "A", targets=ALL_TARGETS, r=8, seed=1, scale=0.5),
        "B": save_adapter(base, root / "B", targets=["q_proj", "v_proj"], r=4, seed=2),
        "C": save_adapter(base, root / "C", targets=["o_proj", "gate_proj", "down_proj"],
                          r=16, alpha=8, seed=3, use_rslora=True, scale=0.5),
    }
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 19, 7, 11, 9)]
    names = ["A", "B", None, "A", "C"]
    refs: list[Reference] = []
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    for prompt, name in zip(prompts, names):
        model = hf_base if name is None else peft_model(base, adapters[name])
        refs.append(hf_greedy(model, prompt, MAX_NEW))
    return base, adapters, list(zip(prompts, names)), refs


def _requests(adapters: dict[str, Path], names: list[str | None]) -> list[LoRARequest | None]:
    ids = {"A": 1, "B": 2, "C": 3}
    return [None if n is None else LoRARequest(n, ids[n], str(adapters[n])) for n in names]


def _check(outputs: list, refs: list[Reference]) -> None:
    for i, (out, ref) in enumerate(zip(outputs, refs, strict=True)):
        assert_greedy_close(out.outputs[0].token_ids, ref, f"prompt {i}")
        assert_logprobs_close(out.outputs[0].logprobs, ref, 2, f"prompt {i}")


def test_mixed_batch_matches_peft_per_adapter(setup: tuple) -> None:
    base, adapters, cases, refs = setup
    prompts, names = [p for p, _ in cases], [n for _, n in cases]
    # the adapters change the output: otherwise the comparison proves nothing
    assert len({tuple(r.token_ids) for r in refs}) == len(refs)
    llm = LLM(str(base), **ENGINE, max_loras=3)
    _check(llm.generate(prompts, PARAMS, use_tqdm=False,
                        lora_request=_requests(adapters, names)), refs)
    assert llm.list_loras() == {1, 2, 3}
    # merge_and_unload: the same tokens as the adapter applied beside the weights
    merged = hf_greedy(peft_model(base, adapters["A"], merged=True), prompts[0], MAX_NEW)
    assert_greedy_close(merged.token_ids, refs[0], "merged A")


def test_max_loras_one_runs_adapters_in_turn(setup: tuple) -> None:
    base, adapters, cases, refs = setup
    prompts, names = [p for p, _ in cases], [n for _, n in cases]
    llm = LLM(str(base), **ENGINE, max_loras=1, max_cpu_loras=2)
    seen: list[set] = []
    execute = llm.engine.runner.execute

    def spy(out):  # every step's distinct adapters
        seen.append({s.lora_request.lora_name for s in out.scheduled if s.lora_request})
        return execute(out)

    llm.engine.runner.execute = spy  # type: ignore[method-assign]
    _check(llm.generate(prompts, PARAMS, use_tqdm=False,
                        lora_request=_requests(adapters, names)), refs)
    assert max(len(s) for s in seen) == 1 and {n for s in seen for n in s} == {"A", "B", "C"}
    runner = llm.engine.runner
    assert len(runner.lora.slots) == 1 and len(runner.lora.host) <= 2  # the LRUs' caps


def test_tensor_parallel_matches_one_rank(setup: tuple) -> None:
    base, adapters, cases, refs = setup
    prompts, names = [p for p, _ in cases], [n for _, n in cases]
    with LLM(str(base), **ENGINE, max_loras=3, tensor_parallel_size=2) as llm:
        outputs = llm.generate(prompts, PARAMS, use_tqdm=False,
                               lora_request=_requests(adapters, names))
        qkv = llm.engine.runner.runner.lora.host  # rank 0's slices: half of B's q rows
        weights = next(w for lora, w in qkv.items() if lora.lora_name == "A")
        assert weights["model.layers.0.self_attn.qkv_proj"].b.shape[0] == (64 + 2 * 32) // 2
        assert weights["model.layers.0.self_attn.o_proj"].a.shape[1] == 64 // 2
    _check(outputs, refs)


def test_smollm2_mixed_batch_matches_peft(tmp_path: Path) -> None:
    """The same on a real model's shapes (SmolLM2-135M: 30 layers, GQA 9:3, tied head)."""
    from tests.tiny_models import smollm2_dir

    base = smollm2_dir()
    adapters = {"A": save_adapter(base, tmp_path / "A", targets=ALL_TARGETS, r=8, seed=4,
                                  scale=0.3),
                "B": save_adapter(base, tmp_path / "B", targets=["q_proj", "v_proj", "down_proj"],
                                  r=4, seed=5)}
    prompt = [1, 504, 3458, 282, 4649, 314]
    names: list[str | None] = ["A", None, "B", "A"]
    prompts = [prompt, prompt, prompt, [1, 18, 19, 20]]
    hf_base = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    peft = {n: peft_model(base, path) for n, path in adapters.items()}
    refs = [hf_greedy(hf_base if n is None else peft[n], p, 6) for p, n in zip(prompts, names)]
    assert len({tuple(r.token_ids) for r in refs[:3]}) == 3  # the adapters change the answer
    llm = LLM(str(base), device="cpu", dtype="float32", num_kv_blocks=64, enable_lora=True,
              max_loras=2)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    _check(llm.generate(prompts, params, use_tqdm=False,
                        lora_request=_requests(adapters, names)), refs)
