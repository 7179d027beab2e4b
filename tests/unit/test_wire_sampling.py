"""The wire's SamplingOptions and the engine's SamplingParams must not drift apart: every field
the engine takes travels on the bus, with the same default."""

from __future__ import annotations

import dataclasses

from shoal.services.worker.engine.sampling_params import SamplingParams
from shoal.shared.schemas.infer import SamplingOptions


def test_same_fields_and_defaults() -> None:
    engine = {f.name: f for f in dataclasses.fields(SamplingParams)}
    wire = SamplingOptions.model_fields
    assert set(engine) == set(wire)
    defaults = SamplingOptions()
    params = SamplingParams()
    for name in engine:
        assert getattr(defaults, name) == getattr(params, name), name


def test_wire_options_build_engine_params() -> None:
    options = SamplingOptions(n=2, temperature=0.5, stop=["\n"], logprobs=3, seed=7)
    params = SamplingParams(**options.model_dump())
    assert (params.n, params.temperature, params.stop, params.logprobs, params.seed) == (2, 0.5, ["\n"], 3, 7)
