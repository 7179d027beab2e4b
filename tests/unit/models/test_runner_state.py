"""ModelRunner per-sequence state: the token copy follows start_pos / prefix_token_ids (so
penalties see the whole sequence after a prefix-cache hit), seeded sampling through the runner
ignores batch mates, and finished sequences are dropped."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.runner.model_runner import ModelRunner
from shoal.services.engine.core.outputs import ScheduledSeq, SchedulerOutput
from shoal.services.engine.sampling_params import SamplingParams
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def runner(tmp_path_factory: pytest.TempPathFactory) -> ModelRunner:
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("llama"))
    return ModelRunner(EngineConfig(model=str(folder), block_size=4, num_kv_blocks=64),
                       Path(folder))


def test_token_copy_follows_start_pos_and_prefix(runner: ModelRunner) -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=1.3)
    runner.execute(SchedulerOutput([ScheduledSeq(1, [5, 6, 7], 0, [0, 1], True, 3, params)]))
    runner.execute(SchedulerOutput([ScheduledSeq(1, [8], 3, [0, 1], True, 3, params)]))
    assert runner.states[1].token_ids == [5, 6, 7, 8]
    # a prefix-cache hit: the runner never saw tokens 0..3 of this new sequence
    runner.execute(SchedulerOutput([ScheduledSeq(2, [9], 4, [0, 2], True, 5, params,
                                                 prefix_token_ids=[5, 6, 7, 8])]))
    assert runner.states[2].token_ids == [5, 6, 7, 8, 9]
    # recomputed after preemption: start_pos 0 resets the copy
    runner.execute(SchedulerOutput([ScheduledSeq(1, [5, 6, 7, 8, 3], 0, [3, 4], True, 3, params)]))
    assert runner.states[1].token_ids == [5, 6, 7, 8, 3]
    runner.execute(SchedulerOutput([], finished_seq_ids=[1, 2]))
    assert runner.states == {}


def test_seeded_sequence_ignores_its_batch_mates(runner: ModelRunner) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234)

    def run(seq_id: int, mates: list[ScheduledSeq]) -> list[int]:
        tokens, pos = [], 6
        out = SchedulerOutput(mates + [ScheduledSeq(seq_id, [3, 4, 5, 6, 7, 8], 0,
                                                    [10, 11, 12], True, 6, seeded)])
        for _ in range(5):
            token = runner.execute(out).sampled_token_ids[seq_id]
            tokens.append(token)
            out = SchedulerOutput([ScheduledSeq(seq_id, [token], pos, [10, 11, 12], True, 6,
                                                seeded)])
            pos += 1
        runner.execute(SchedulerOutput([], finished_seq_ids=[seq_id]))
        return tokens

    alone = run(20, [])
    mates = [ScheduledSeq(30 + i, [7 + i] * (i + 2), 0, [20 + 2 * i, 21 + 2 * i], True, i + 2,
                          SamplingParams(temperature=0.7)) for i in range(3)]
    assert run(21, mates) == alone
