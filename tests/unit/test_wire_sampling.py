"""The wire's SamplingOptions and the engine's SamplingParams must not drift apart: every field
the engine takes travels on the bus, with the same default."""

from __future__ import annotations

import dataclasses

from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams
from shoal.shared.schemas.infer import SamplingOptions, StructuredOutputsOptions


def test_same_fields_and_defaults() -> None:
    """Engine-set fields (init=False: the compiled grammar) never travel."""
    engine = {f.name: f for f in dataclasses.fields(SamplingParams) if f.init}
    wire = SamplingOptions.model_fields
    assert set(engine) == set(wire)
    defaults = SamplingOptions()
    params = SamplingParams()
    for name in engine:
        assert getattr(defaults, name) == getattr(params, name), name


def test_structured_outputs_mirror_the_engine_spec() -> None:
    engine = {f.name: f for f in dataclasses.fields(StructuredOutputsParams)}
    fields = StructuredOutputsOptions.model_fields
    wire = {info.alias or name: info for name, info in fields.items()}
    assert set(engine) == set(wire)
    defaults = StructuredOutputsOptions().model_dump()
    for name, f in engine.items():
        assert defaults[name] == f.default, name


def test_structured_outputs_cross_the_wire() -> None:
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {}}}
    options = SamplingOptions.model_validate(
        {"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert options.structured_outputs is not None and options.structured_outputs.json_ == schema
    params = SamplingParams(**SamplingOptions.model_validate_json(options.model_dump_json())
                            .model_dump())
    spec = params.structured_outputs
    assert isinstance(spec, StructuredOutputsParams) and spec.json == schema
    assert spec.disable_any_whitespace and spec.kind == "json"
    assert list(json_keys(spec.json_text)) == ["b", "a"]  # property order is generation order
    choice = SamplingParams(**SamplingOptions(
        structured_outputs=StructuredOutputsOptions(choice=["x", "y"])).model_dump())
    assert choice.structured_outputs == StructuredOutputsParams(choice=["x", "y"])


def json_keys(text: str) -> list[str]:
    import json

    return list(json.loads(text)["properties"])


def test_wire_options_build_engine_params() -> None:
    options = SamplingOptions(n=2, temperature=0.5, stop=["\n"], logprobs=3, seed=7)
    params = SamplingParams(**options.model_dump())
    assert (params.n, params.temperature, params.stop, params.logprobs, params.seed) == (2, 0.5,
                                                                                         ["\n"], 3,
                                                                                         7)


def test_logit_bias_crosses_the_wire_with_int_ids() -> None:
    options = SamplingOptions(logit_bias={50256: -100.0, 7: 2.5})
    params = SamplingParams(**SamplingOptions.model_validate_json(options.model_dump_json())
                            .model_dump())
    assert params.logit_bias == {50256: -100.0, 7: 2.5}
