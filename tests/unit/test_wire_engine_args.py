"""The wire's EngineArgs and the engine's EngineConfig must not drift apart: every setting a
deployment may give travels as a typed field (None = the engine's default), the rest is the
worker's or a top-level ModelSpec field, and what EngineConfig refuses the wire refuses first,
at deploy time, naming the field."""

from __future__ import annotations

import dataclasses
import json

import pytest
from pydantic import ValidationError

from shoal.services.engine import ConfigError, EngineConfig
from shoal.shared.bus.codec import decode
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.engine_args import EngineArgs
from shoal.shared.schemas.registry import ModelCreate, ModelSpec

NOT_ENGINE_ARGS = {"model", "tokenizer", "device", "cache_dir", "tensor_parallel_size",
                   "pipeline_parallel_size", "distributed_init_method"}
"""The worker's to decide: what the placement (its tp / pp, from ModelSpec.tp / pp) and the
model's source say."""
TOP_LEVEL = {"max_model_len", "dtype", "gpu_memory_utilization"}
"""ModelSpec's own fields (GPUStack's shape)."""

BAD = [("block_size", 12), ("block_size", 0), ("max_num_seqs", 0), ("max_num_batched_tokens", -1),
       ("kv_cache_memory", 0), ("num_kv_blocks", 0), ("num_threads", 0),
       ("tool_call_parser", "nonsense"), ("reasoning_parser", "hermes"), ("quantization", "fp4"),
       ("load_format", "pt"),
       ("speculative_config", {"method": "ngram", "num_speculative_tokens": 0}),
       ("speculative_config", {"method": "medusa", "num_speculative_tokens": 2}),
       ("task", "classify"), ("override_pooler_config", {"pooling_type": "STEP"}),
       ("override_pooler_config", {"softmax": True})]


def test_every_engine_setting_travels_once() -> None:
    engine = {f.name for f in dataclasses.fields(EngineConfig)}
    wire = set(EngineArgs.model_fields)
    assert wire == engine - NOT_ENGINE_ARGS - TOP_LEVEL
    assert TOP_LEVEL <= set(ModelSpec.model_fields)
    assert all(v is None for v in EngineArgs().model_dump().values())  # no default restated


def test_given_args_build_an_engine_config() -> None:
    args = EngineArgs(max_num_seqs=8, kv_cache_memory=64 * 2**20, enable_prefix_caching=False,
                      tool_call_parser="hermes")
    config = EngineConfig(model="m", **args.given())
    assert (config.max_num_seqs, config.kv_cache_memory, config.enable_prefix_caching,
            config.tool_call_parser) == (8, 64 * 2**20, False, "hermes")
    assert EngineConfig(model="m", **EngineArgs().given()) == EngineConfig(model="m")


@pytest.mark.parametrize(("field", "value"), BAD)
def test_what_the_engine_refuses_is_refused_at_deploy_time(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as engine_err:
        EngineConfig(model="m", **{field: value})
    assert engine_err.value.param == field
    body = {"name": "m", "source": "/m", "engine_args": {field: value}}
    with pytest.raises(InvalidRequest) as wire_err:  # the registry's decode of a deploy: a 400
        decode(json.dumps(body).encode(), ModelCreate)
    assert wire_err.value.param.startswith(f"engine_args.{field}")  # or its nested field


def test_quantization_travels() -> None:
    assert EngineConfig(model="m", **EngineArgs(quantization="int8").given()).quantization == "int8"


def test_unknown_args_and_cross_field_rules_are_refused() -> None:
    with pytest.raises(ValidationError, match="no_such_arg"):
        EngineArgs.model_validate({"no_such_arg": 1})
    with pytest.raises(ValidationError, match="max_num_batched_tokens"):
        ModelSpec(source="/m", max_model_len=4096, engine_args=EngineArgs(
            enable_chunked_prefill=False, max_num_batched_tokens=2048))
    with pytest.raises(ConfigError):
        EngineConfig(model="m", max_model_len=4096, enable_chunked_prefill=False,
                     max_num_batched_tokens=2048)
    body = {"name": "m", "source": "org/model", "engine_args": {"quantization": "gguf"}}
    with pytest.raises(InvalidRequest, match="quantization"):  # a 400 at deploy
        decode(json.dumps(body).encode(), ModelCreate)
    assert ModelSpec(source="/m/x.gguf", engine_args=EngineArgs(quantization="gguf"))


def test_speculative_config_travels_as_an_object_or_json_text() -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    for value in (spec, json.dumps(spec)):
        config = EngineConfig(model="m", **EngineArgs(speculative_config=value).given())
        assert config.speculative_config is not None
        assert (config.speculative_config.method, config.speculative_config.prompt_lookup_min,
                config.speculative_config.prompt_lookup_max) == ("ngram", 3, 3)


def test_pooler_config_travels_as_json_or_the_forms_text() -> None:
    """vLLM's override_pooler_config as JSON text (the CLI's --engine-arg) or key=value text
    (the dashboard's map field): the engine gets one dict, pooling_type upper-cased."""
    for given in ('{"pooling_type": "last", "normalize": false}',
                  {"pooling_type": "LAST", "normalize": "false"}):
        args = EngineArgs(task="embed", override_pooler_config=given)
        config = EngineConfig(model="m", **args.given())
        assert config.override_pooler_config == {"pooling_type": "LAST", "normalize": False}
        assert config.task == "embed"
