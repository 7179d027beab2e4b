"""The Triton op set: chosen by device, call-compatible with the torch set, and the tiny models
run through it (interpreter on CPU) give the torch path's logits and greedy tokens."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from tests.seeding import fresh_generator

from shoal.kernels import TORCH_OPS, Ops, select_ops
from shoal.services.engine.runner import model_runner as model_runner_module
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.model_runner import ModelRunner
from shoal.services.engine.core.outputs import ScheduledSeq, SchedulerOutput
from shoal.services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, save_tiny_model, with_config
from tests.unit.kernels_triton.triton_helpers import DEVICE, needs_cuda, tensors_beside_inputs

OPS = ["reshape_and_cache", "paged_attention", "rms_norm", "apply_rotary"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def test_select_ops_by_device_and_forced() -> None:
    assert select_ops("cpu").name == "cpp"  # the C++ CPU ops (this machine has g++)
    assert select_ops("cpu", force="torch") is TORCH_OPS
    assert select_ops(torch.device("cuda")).name == "triton"
    assert select_ops("cpu", force="triton").name == "triton"
    assert select_ops("cuda", force="torch") is TORCH_OPS
    with pytest.raises(ValueError):
        select_ops("cpu", force="cuda")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("op_set", ["triton", "cpp"])
def test_same_call_signature_as_torch(op: str, op_set: str) -> None:
    ours = inspect.signature(getattr(select_ops("cpu", force=op_set), op))
    ref = inspect.signature(getattr(TORCH_OPS, op))
    positional = [p for p in ours.parameters.values() if p.kind != p.KEYWORD_ONLY]
    expected = [p for p in ref.parameters.values()  # a gather tuning the C++ op does not need
                if (op_set == "triton" or p.name != "max_group_bytes")
                and p.kind != p.KEYWORD_ONLY]
    assert [(p.name, p.default) for p in positional] == [(p.name, p.default) for p in expected]
    if op == "paged_attention":  # Gemma 2's soft-cap, gpt-oss's sinks: by keyword, every set
        for name in ("softcap", "sinks"):
            assert ours.parameters[name].kind == ours.parameters[name].KEYWORD_ONLY
            assert ref.parameters[name].default is None


def _runner(folder: Path, ops: Ops, monkeypatch: pytest.MonkeyPatch) -> ModelRunner:
    monkeypatch.setattr(model_runner_module, "select_ops", lambda device: ops)
    # fp32 on the test device (the interpreter on CPU), no graphs: the op set is the only change
    return ModelRunner(EngineConfig(model=str(folder), block_size=4, num_kv_blocks=64,
                                    device=DEVICE.type, dtype="float32", enforce_eager=True),
                       folder)


def _blocks(i: int) -> list[int]:
    return list(range(i * 16, i * 16 + 16))


# llama, qwen3: the rope variants and q/k norms; mistral with a 6-token sliding window (every
# layer), which the prompts and decodes pass; qwen2 adds nothing the kernel tests do not cover;
# gemma2: soft-capped attention in the Triton op, beside a 6-token window on its first layer;
# phi3: a partial rotary (the rotated part handed to the op as a whole head); gpt_oss: attention
# sinks in the Triton op, beside a 6-token window on its first layer
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral", "gemma2", "phi3", "gpt_oss"])
def test_tiny_model_greedy_parity(arch: str, tmp_path: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Same greedy tokens and close logits: a chunked prompt next to a whole one, then decodes;
    every step under tensors_beside_inputs, so a tensor either op set makes on the wrong device
    fails here on the CPU as it would on a GPU."""
    folder = save_tiny_model(arch, tmp_path / arch)
    if arch in ("mistral", "gemma2", "gpt_oss"):
        folder = with_config(folder, tmp_path / "windowed", sliding_window=6)
    runners = [_runner(folder, TORCH_OPS, monkeypatch),
               _runner(folder, select_ops(DEVICE, force="triton"), monkeypatch)]
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 14)]
    results = []
    for runner in runners:
        with tensors_beside_inputs():
            results.append(_greedy(runner, prompts))
    assert results[0] == results[1]


def _greedy(runner: ModelRunner, prompts: list[list[int]]) -> list[list[int]]:
    """Prompt 0 whole beside prompt 1's first chunk, prompt 1's rest, then five decodes."""
    tokens = [list(p) for p in prompts]
    out = SchedulerOutput([ScheduledSeq(0, prompts[0], 0, _blocks(0), True, 5, GREEDY),
                           ScheduledSeq(1, prompts[1][:9], 0, _blocks(1), False, 14, GREEDY)])
    runner.execute(out)
    out = SchedulerOutput([ScheduledSeq(1, prompts[1][9:], 9, _blocks(1), True, 14, GREEDY)])
    tokens[1].append(runner.execute(out).sampled_token_ids[1])
    out = SchedulerOutput([ScheduledSeq(0, prompts[0], 0, _blocks(0), True, 5, GREEDY)])
    tokens[0].append(runner.execute(out).sampled_token_ids[0])
    for _ in range(5):
        out = SchedulerOutput([ScheduledSeq(i, [t[-1]], len(t) - 1, _blocks(i), True,
                                            len(prompts[i]), GREEDY)
                               for i, t in enumerate(tokens)])
        sampled = runner.execute(out).sampled_token_ids
        for i, t in enumerate(tokens):
            t.append(sampled[i])
    return tokens


@needs_cuda
def test_engine_gives_gpu_memory_back(tmp_path: Path) -> None:
    """The first GPU run: a second LLM after `with LLM(...)` found 90% of the GPU still held and
    refused ("leaves no room for the KV cache"). The pool is sized by profiling both times."""
    from shoal.services.engine.frontend.llm import LLM

    folder = save_tiny_model("llama", tmp_path / "llama")
    before = torch.cuda.memory_allocated()
    for _ in range(2):
        with LLM(str(folder), device="cuda", dtype="bfloat16") as llm:
            params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
            out = llm.generate([[5, 6, 7]], params, use_tqdm=False)
            assert len(out[0].outputs[0].token_ids) == 3
        assert torch.cuda.memory_allocated() <= before + (1 << 20)
