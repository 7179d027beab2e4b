"""CUDA path of the runner: decode-graph batch sizes and padding (checked eagerly on CPU through
the Triton ops), the profiling batch, and on a GPU: graphs replay the eager result, the pool is
profiled, and bf16 greedy tokens match transformers on CUDA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.tiny_models import VOCAB, save_tiny_model
from tests.unit.kernels_triton.triton_helpers import DEVICE, needs_cuda

from shoal.kernels import select_ops
from shoal.services.engine.runner import model_runner as model_runner_module
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.cuda_graphs import DecodeGraphs, graph_batch_sizes
from shoal.services.engine.runner.gpu_memory import dummy_batch
from shoal.services.engine.runner.input_batch import build_model_inputs
from shoal.services.engine.runner.model_runner import ModelRunner
from shoal.services.engine.core.outputs import ScheduledSeq, SchedulerOutput
from shoal.services.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


def test_graph_batch_sizes() -> None:
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert graph_batch_sizes(4096)[-1] == 512


def test_dummy_batch_covers_the_token_budget() -> None:
    ids, positions, meta = dummy_batch(2048, 256, 4096, 16, torch.device("cpu"))
    assert ids.shape == positions.shape == (2048,) and meta.seq_lens.tolist() == [8] * 256
    _, positions, meta = dummy_batch(100, 3, 4096, 16, torch.device("cpu"))
    assert meta.seq_lens.tolist() == [34, 33, 33] and int(meta.query_start_loc[-1]) == 100
    assert bool((meta.slot_mapping == -1).all()) and meta.block_tables.shape == (3, 3)
    _, _, meta = dummy_batch(8192, 1, 2048, 16, torch.device("cpu"))
    assert meta.seq_lens.tolist() == [2048]  # capped at max_model_len


def _decode_step(n: int, start: int) -> SchedulerOutput:
    gen = torch.Generator().manual_seed(n)
    return SchedulerOutput([ScheduledSeq(i, [int(torch.randint(3, VOCAB, (1,), generator=gen))],
                                         start, list(range(i * 3, i * 3 + 3)), True, 1, GREEDY)
                            for i in range(n)])


def test_padded_static_buffers_match_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay path's buffers, padded up, give the eager forward's hidden states (on CPU the
    same buffers run without a graph, through the Triton ops in the interpreter)."""
    folder = save_tiny_model("llama", tmp_path / "llama")
    monkeypatch.setattr(model_runner_module, "select_ops",
                        lambda device: select_ops(device, force="triton"))
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=4, num_kv_blocks=64,
                                      device=DEVICE.type, dtype="float32", enforce_eager=True),
                         folder)
    # fill the cache with something other than zeros: a prompt of 5 tokens per sequence
    prompts = SchedulerOutput([ScheduledSeq(i, list(range(3 + i, 8 + i)), 0,
                                            list(range(i * 3, i * 3 + 3)), False, 5, GREEDY)
                               for i in range(10)])
    runner.execute(prompts)
    graphs = DecodeGraphs(runner.model, 10, 5, runner.device, use_graphs=False)
    graphs.capture()
    for n in (3, 8, 9):  # padded to 4, exact 8, padded to 10
        step = _decode_step(n, 5)
        inputs = build_model_inputs(step, 4, runner.device)
        assert graphs.can_run(inputs)
        with torch.inference_mode():
            eager = runner.model(inputs.input_ids, inputs.positions,
                                 build_model_inputs(step, 4, runner.device).meta)
            replayed = graphs.run(build_model_inputs(step, 4, runner.device)).clone()
        torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    prefill = build_model_inputs(prompts, 4, runner.device)
    assert not graphs.can_run(prefill)


@needs_cuda
def test_cuda_runner_graphs_and_parity_with_transformers(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = save_tiny_model("llama", tmp_path / "llama")
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=16, max_num_seqs=32,
                                      gpu_memory_utilization=0.5), folder)
    assert runner.dtype == torch.bfloat16 and runner.graphs is not None
    assert runner.num_kv_blocks > 0
    assert runner.model.model.layers[0].self_attn.attn.ops.name == "triton"
    eager = ModelRunner(EngineConfig(model=str(folder), block_size=16, max_num_seqs=32,
                                     num_kv_blocks=256, enforce_eager=True), folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
    hf.generation_config.eos_token_id = None  # decode the full length, as ignore_eos does
    prompt = list(range(5, 17))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt], device="cuda"), max_new_tokens=16,
                          do_sample=False)[0].tolist()
    for r in (runner, eager):
        tokens = list(prompt)
        out = SchedulerOutput([ScheduledSeq(0, prompt, 0, list(range(8)), True, 12, GREEDY)])
        for _ in range(16):
            tokens.append(r.execute(out).sampled_token_ids[0])
            out = SchedulerOutput([ScheduledSeq(0, [tokens[-1]], len(tokens) - 1, list(range(8)),
                                                True, 12, GREEDY)])
        r.execute(SchedulerOutput([], finished_seq_ids=[0]))
        if tokens != ref:  # bf16: a flip is allowed only at a near-tie of transformers' logprobs
            step = next(i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b)
            with torch.no_grad():
                lp = torch.log_softmax(hf(torch.tensor([ref[:step]], device="cuda")).logits[0, -1]
                                       .float(), -1)
            gap = float(lp[ref[step]] - lp[tokens[step]])
            assert gap < 0.05, f"step {step}: {tokens[step]} vs {ref[step]}, logprob gap {gap}"
