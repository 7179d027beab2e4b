"""A model is built in its serving dtype (runner/loader.py's `building_in`): a bf16 engine never
holds a float32 copy of the weights while loading (that used to double its peak memory), and
what a module computes at build in float32 (rotary cos/sin) is the same as before."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tests.tiny_models import ARCHS, save_tiny_model, tiny_config
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from shoal.kernels import select_ops
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.models.registry import model_class
from shoal.services.engine.runner import model_runner
from shoal.services.engine.runner.loader import building_in, load_model_weights
from shoal.services.engine.runner.model_runner import ModelRunner

CPU = torch.device("cpu")


def test_a_bf16_runner_loads_into_bf16_parameters(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The parameters the checkpoint is read into are already bf16: no float32 copy exists."""
    folder = save_tiny_model("llama", tmp_path / "llama")
    seen: list[set[torch.dtype]] = []

    def loading(model: torch.nn.Module, model_dir: Path, load_format: str = "auto",
                supplied: frozenset[str] = frozenset()) -> None:
        seen.append({p.dtype for p in model.parameters()})
        load_model_weights(model, model_dir, load_format, supplied)

    monkeypatch.setattr(model_runner, "load_model_weights", loading)
    runner = ModelRunner(EngineConfig(model=str(folder), dtype="bfloat16", device="cpu",
                                      block_size=4, num_kv_blocks=16), folder)
    assert seen == [{torch.bfloat16}]
    assert {p.dtype for p in runner.model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32  # the default is restored


@pytest.mark.parametrize("arch", ARCHS)
def test_buffers_built_in_bf16_are_the_float32_builds(arch: str) -> None:
    """Every family: parameters bf16, buffers (rotary cos/sin) bit-identical to a float32 build."""
    cfg = tiny_config(arch)
    cfg.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[cfg.model_type]]
    ops = select_ops(CPU)
    reference = model_class(cfg)(cfg, 256, ops)
    with building_in(torch.bfloat16, CPU):
        model = model_class(cfg)(cfg, 256, ops)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    buffers = dict(reference.named_buffers())
    assert buffers, "a model with rotary embeddings has buffers"
    for name, buffer in model.named_buffers():
        assert buffer.dtype == buffers[name].dtype, name
        assert torch.equal(buffer, buffers[name]), name
