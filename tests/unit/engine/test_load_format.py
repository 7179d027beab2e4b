"""load_format="dummy" (vLLM's): random weights of a folder's config.json, no weight files read,
so a model nobody downloaded runs (the 1B benchmarks); and the setting's rules."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from shoal.services.engine import LLM, ConfigError, EngineConfig, SamplingParams
from shoal.services.engine.runner.loader import DUMMY_RANGE, initialize_dummy_weights
from shoal.shared.schemas.engine_args import EngineArgs
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def config_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama's folder with its weight files removed: config.json + tokenizer only."""
    folder = save_tiny_model("llama", tmp_path_factory.mktemp("dummy") / "llama")
    for file in folder.glob("*.safetensors"):
        file.unlink()
    return folder


def test_dummy_runs_a_folder_without_weights(config_only: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    outs = []
    for _ in range(2):
        with LLM(str(config_only), load_format="dummy", device="cpu", num_threads=1,
                 kv_cache_memory=8 * 2**20) as llm:
            weights = [p for p in llm.engine.runner.model.parameters() if p.is_floating_point()]
            outs.append(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids)
            big = max(float(p.abs().max()) for p in weights
                      if p.dtype == torch.float32 and p.numel())
            assert 0 < big <= DUMMY_RANGE[1]
    assert len(outs[0]) == 6 and outs[0] == outs[1]  # seeded: the same weights each time
    with pytest.raises(ConfigError, match="safetensors"):  # the default still reads files
        LLM(str(config_only), device="cpu", num_threads=1, kv_cache_memory=8 * 2**20)


def test_dummy_weights_are_seeded_and_small() -> None:
    a, b = torch.nn.Linear(16, 8).to(torch.bfloat16), torch.nn.Linear(16, 8).to(torch.bfloat16)
    initialize_dummy_weights(a)
    initialize_dummy_weights(b)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)
    assert float(a.weight.float().abs().max()) <= DUMMY_RANGE[1] * 1.01  # (bf16 rounding)
    assert a.weight.float().std() > 0


def test_load_format_rules() -> None:
    assert EngineConfig(model="m").load_format == "auto"
    with pytest.raises(ConfigError) as err:
        EngineConfig(model="m", load_format="pt")
    assert err.value.param == "load_format"
    with pytest.raises(ConfigError, match="gguf"):
        EngineConfig(model="m.gguf", load_format="dummy")
    assert EngineArgs(load_format="dummy").given() == {"load_format": "dummy"}
    with pytest.raises(ValueError, match="load_format"):
        EngineArgs(load_format="npcache")
    json.dumps(EngineArgs(load_format="dummy").model_dump())
