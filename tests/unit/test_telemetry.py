"""Tracing settings: the exporter named by SHOAL_OTEL_EXPORTER, OTLP's protocol from the standard
OTEL_EXPORTER_OTLP_* variables (vLLM's default, gRPC, or http/protobuf), anything unknown an
error at start; and the GenAI attributes of a request."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as Grpc
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http
from pydantic import ValidationError

from shoal.shared.config import Settings
from shoal.shared.genai import request_attributes, response_attributes
from shoal.shared.schemas.infer import ChatMessage, GenerateRequest, SamplingOptions, Usage
from shoal.shared.telemetry import otlp_exporter, setup_tracing


def test_otlp_protocol_follows_the_standard_variables() -> None:
    assert isinstance(otlp_exporter({}), Grpc)
    assert isinstance(otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}), Http)
    assert isinstance(otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
                                     "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}), Grpc)
    with pytest.raises(ValueError, match="http/json"):
        otlp_exporter({"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"})


def test_an_unknown_exporter_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOAL_OTEL_EXPORTER", "jaeger")
    with pytest.raises(ValidationError, match="otel_exporter"):
        Settings()
    with pytest.raises(ValueError, match="SHOAL_OTEL_EXPORTER must be one of none, console, otlp"):
        setup_tracing("shoal-test", "jaeger")


def test_genai_attributes_of_a_request_and_its_answer() -> None:
    req = GenerateRequest(request_id="r", model="smol",
                          messages=[ChatMessage(role="user", content="hi")],
                          sampling=SamplingOptions(max_tokens=7, temperature=0.5, seed=3,
                                                   stop=["\n"], n=2))
    attrs = request_attributes(req, stream=True)
    assert attrs["gen_ai.operation.name"] == "chat" and attrs["gen_ai.request.model"] == "smol"
    assert (attrs["gen_ai.request.max_tokens"], attrs["gen_ai.request.temperature"],
            attrs["gen_ai.request.seed"], attrs["gen_ai.request.choice.count"]) == (7, 0.5, 3, 2)
    assert attrs["gen_ai.request.stop_sequences"] == ["\n"] and attrs["gen_ai.request.stream"]
    assert "gen_ai.request.top_k" not in attrs  # unset: not sent
    out = response_attributes(Usage(prompt_tokens=5, completion_tokens=2, cached_tokens=1),
                              ["stop", "length"], "chatcmpl-1", "smol")
    assert out == {"gen_ai.response.finish_reasons": ["stop", "length"],
                   "gen_ai.usage.input_tokens": 5, "gen_ai.usage.output_tokens": 2,
                   "gen_ai.usage.cache_read.input_tokens": 1, "gen_ai.response.id": "chatcmpl-1",
                   "gen_ai.response.model": "smol"}
