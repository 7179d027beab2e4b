"""An engine gives its memory back when it ends (issue 27: a second LLM after `with LLM(...)` found
the GPU still full): shutdown, the `with` block's end and `del llm` free the weights and the KV
cache, and a parallel engine's `del` ends its ranks, so a second one can start in this process."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest

from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import ShoalError
from tests.tiny_models import save_tiny_model

ENGINE = dict(device="cpu", dtype="float32", block_size=4, num_kv_blocks=64)
GREEDY = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("llama"), seed=2)


def _held(llm: LLM) -> list[weakref.ref]:
    """Weak references to the runner's KV pool and a weight, wherever the runner keeps them."""
    runner = llm.engine.runner
    runner = getattr(runner, "runner", runner)  # a parallel executor's rank 0, in this process
    return [weakref.ref(runner.kv_caches[0]), weakref.ref(next(runner.model.parameters()))]


def test_with_block_end_frees_weights_and_kv_cache(folder: Path) -> None:
    with LLM(str(folder), **ENGINE) as llm:  # type: ignore[arg-type]
        first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        held = _held(llm)
    gc.collect()
    assert [ref() for ref in held] == [None, None]
    with pytest.raises(ShoalError, match="shut down"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    again = LLM(str(folder), **ENGINE).generate(PROMPTS, GREEDY, use_tqdm=False)  # type: ignore[arg-type]
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in first]


def test_del_frees_the_engine(folder: Path) -> None:
    llm = LLM(str(folder), **ENGINE)  # type: ignore[arg-type]
    held = _held(llm)
    del llm
    gc.collect()
    assert [ref() for ref in held] == [None, None]


def test_del_of_a_parallel_engine_lets_another_start(folder: Path) -> None:
    llm = LLM(str(folder), tensor_parallel_size=2, **ENGINE)  # type: ignore[arg-type]
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    procs = list(llm.engine.runner.procs.values())
    del llm
    gc.collect()
    assert all(p.poll() is not None for p in procs)  # its rank processes ended
    with LLM(str(folder), tensor_parallel_size=2, **ENGINE) as again:  # type: ignore[arg-type]
        second = again.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in second] == [o.outputs[0].token_ids for o in first]
