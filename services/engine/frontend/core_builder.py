"""build_core: an EngineCore from its config, with everything the core is handed rather than
builds, so that core/ imports no torch, no model code and no tokenizer library: the model
prepared (model_prep), the runner started (the model runner in this process, or the ranks'
executor under tensor / pipeline parallelism) and the tokenizer loaded. The front ends (LLM,
AsyncEngine) and the engine process build their core here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.engine_core import EngineCore, Runner
from shoal.services.engine.frontend.tokenizer import load_tokenizer
from shoal.services.engine.model_prep import prepare_model


def build_core(config: EngineConfig, *, runner: Runner | None = None, tokenizer: Any = None,
               model_dir: Path | None = None) -> EngineCore:
    """model_dir: the model already prepared by the caller, which showed its progress; else
    config.model is prepared here. runner / tokenizer: given (tests, or the engine process's
    executor for ranks on several workers), else built from the config."""
    if runner is None:
        if model_dir is None:
            model_dir = prepare_model(config.model,
                                      Path(config.cache_dir) if config.cache_dir else None,
                                      gguf_blocks=gguf_blocks(config))
        runner = build_runner(config, model_dir)
    if tokenizer is None:
        tokenizer = load_tokenizer(config.tokenizer or model_dir or config.model)
    return EngineCore(config, runner=runner, tokenizer=tokenizer, model_dir=model_dir)


def gguf_blocks(config: EngineConfig) -> bool:
    """Whether this engine runs a .gguf's own blocks, so its folder can leave them in the file."""
    from shoal.services.engine.layers.cpu_weights import wants_gguf_blocks

    return wants_gguf_blocks(config.model, config.device, config.quantization,
                             config.tensor_parallel_size * config.pipeline_parallel_size)


def build_runner(config: EngineConfig, model_dir: Path) -> Runner:
    """The model runner, or with tp * pp > 1 the executor that drives every rank (imported only
    here: `from shoal import LLM` loads no torch)."""
    if config.tensor_parallel_size * config.pipeline_parallel_size > 1:
        from shoal.services.engine.distributed.executor import MultiprocExecutor

        return MultiprocExecutor(config, model_dir)
    from shoal.services.engine.runner.model_runner import ModelRunner

    return ModelRunner(config, model_dir)
