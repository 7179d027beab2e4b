"""One trace spans the bus: the W3C context a client puts in NATS headers parents the
registry's server span."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.schemas.registry import ModelCreate

pytestmark = pytest.mark.integration


async def test_trace_context_rides_in_nats_headers(client: RegistryClient) -> None:
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))

    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("client-call") as parent:
        await client.create_model(ModelCreate(name=f"traced-{uuid.uuid4().hex[:6]}", source="/m"))
    spans = {s.name: s for s in exporter.get_finished_spans()}
    server = spans["models.create"]
    assert server.kind is trace.SpanKind.SERVER
    assert server.context.trace_id == parent.get_span_context().trace_id
    assert server.parent is not None and server.parent.span_id == parent.get_span_context().span_id
