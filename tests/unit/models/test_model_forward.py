"""Forward parity with transformers (fp32) for each tiny architecture: whole prompts in one
varlen batch, prompts split into chunks across steps next to decodes, and greedy decoding."""

from __future__ import annotations


import pytest
import torch
from tests.seeding import fresh_generator
from tests.tiny_models import ARCHS, VOCAB, engine_args, save_tiny_model
from transformers import AutoModelForCausalLM

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.input_batch import build_model_inputs
from shoal.services.engine.runner.model_runner import ModelRunner
from shoal.services.engine.core.outputs import ScheduledSeq, SchedulerOutput
from shoal.services.engine.sampling_params import SamplingParams

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)


@pytest.fixture(scope="module", params=ARCHS)
def arch_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
              ) -> tuple[ModelRunner, torch.nn.Module]:
    folder = save_tiny_model(request.param, tmp_path_factory.mktemp(request.param))
    runner = ModelRunner(EngineConfig(model=str(folder), block_size=BLOCK, num_kv_blocks=96,
                                      **engine_args(request.param)), folder)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # decode the full length, as ignore_eos does
    return runner, hf


def _blocks(seq_index: int) -> list[int]:
    return list(range(seq_index * 24, seq_index * 24 + 24))  # 96 tokens per sequence


def _forward(runner: ModelRunner, seqs: list[ScheduledSeq]) -> torch.Tensor:
    """All positions' logits [num_tokens, vocab] for one varlen step."""
    inputs = build_model_inputs(SchedulerOutput(seqs), runner.block_size, runner.device)
    with torch.inference_mode():
        hidden = runner.model(inputs.input_ids, inputs.positions, inputs.meta)
        return runner.model.compute_logits(hidden, torch.arange(hidden.shape[0]))


def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def test_varlen_prefill_matches(arch_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = arch_pair
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (5, 17, 1, 8)]
    seqs = [ScheduledSeq(i, p, 0, _blocks(i), True, len(p), GREEDY) for i, p in enumerate(prompts)]
    logits = _forward(runner, seqs)
    start = 0
    for p in prompts:
        torch.testing.assert_close(logits[start:start + len(p)], _hf_logits(hf, p),
                                   atol=1e-4, rtol=1e-4)
        start += len(p)


def test_chunked_prefill_next_to_decodes_matches(arch_pair: tuple[ModelRunner, torch.nn.Module]
                                                 ) -> None:
    runner, hf = arch_pair
    gen = fresh_generator()
    short = torch.randint(3, VOCAB, (6,), generator=gen).tolist()
    long = torch.randint(3, VOCAB, (23,), generator=gen).tolist()
    # step 1: short prompt whole + the first 7 tokens of the long one
    first = _forward(runner, [ScheduledSeq(0, short, 0, _blocks(0), True, 6, GREEDY),
                              ScheduledSeq(1, long[:7], 0, _blocks(1), False, 23, GREEDY)])
    # step 2: a decode for the short one + the long one's next 9 (crossing block boundaries)
    extra = [int(first[5].argmax())]
    second = _forward(runner, [ScheduledSeq(0, extra, 6, _blocks(0), True, 6, GREEDY),
                               ScheduledSeq(1, long[7:16], 7, _blocks(1), False, 23, GREEDY)])
    # step 3: the rest of the long one alone
    third = _forward(runner, [ScheduledSeq(1, long[16:], 16, _blocks(1), True, 23, GREEDY)])
    ref_long = _hf_logits(hf, long)
    torch.testing.assert_close(torch.cat([first[6:], second[1:], third]), ref_long,
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(second[0], _hf_logits(hf, short + extra)[-1], atol=1e-4, rtol=1e-4)


def test_greedy_decode_matches_generate(arch_pair: tuple[ModelRunner, torch.nn.Module]) -> None:
    runner, hf = arch_pair
    gen = fresh_generator()
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (3, 11)]
    tokens = [list(p) for p in prompts]
    out = SchedulerOutput([ScheduledSeq(10 + i, p, 0, _blocks(i), True, len(p), GREEDY)
                           for i, p in enumerate(prompts)])
    for _ in range(12):
        sampled = runner.execute(out).sampled_token_ids
        for i, t in enumerate(tokens):
            t.append(sampled[10 + i])
        out = SchedulerOutput([ScheduledSeq(10 + i, [t[-1]], len(t) - 1, _blocks(i), True,
                                            len(prompts[i]), GREEDY) for i, t in enumerate(tokens)])
    runner.execute(SchedulerOutput([], finished_seq_ids=[10, 11]))
    assert not runner.states
    for p, t in zip(prompts, tokens):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False)[0].tolist()
        assert t == ref, f"greedy tokens differ: {t[len(p):]} vs {ref[len(p):]}"
