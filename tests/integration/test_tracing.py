"""One trace spans the bus: the W3C context a client puts in NATS headers parents the
registry's server span."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.schemas.events import ModelEvent
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


async def test_an_event_continues_the_trace_of_the_call_that_made_it(client: RegistryClient,
                                                                      bus: Bus) -> None:
    """The outbox row keeps the registry call's trace context and the relay publishes with it:
    a consumer of the event (a plain subscriber, as gateways and workers are, and a durable
    JetStream consumer, as the scheduler is) handles it in a span of the client's trace."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    name = f"evtrace-{uuid.uuid4().hex[:6]}"
    heard: asyncio.Queue[str] = asyncio.Queue()

    async def on_event(event: ModelEvent, _msg: object) -> None:
        if event.data.name == name:
            await heard.put("plain")

    async def on_durable(msg: Msg) -> None:
        if ModelEvent.model_validate_json(msg.data).data.name == name:
            await heard.put("durable")

    stop = asyncio.Event()
    sub = await bus.subscribe(bus.subjects.events_of("models"), ModelEvent, on_event)
    durable = asyncio.create_task(bus.consume(f"trace-{uuid.uuid4().hex[:6]}",
                                              bus.subjects.events_of("models"), on_durable, stop))
    try:
        await asyncio.sleep(1.0)  # the durable consumer exists before the event
        tracer = trace.get_tracer("test")
        with tracer.start_as_current_span("client-call") as parent:
            await client.create_model(ModelCreate(name=name, source="/m"))
        got = {await asyncio.wait_for(heard.get(), 15), await asyncio.wait_for(heard.get(), 15)}
        assert got == {"plain", "durable"}
    finally:
        stop.set()
        await sub.unsubscribe()
        await asyncio.wait_for(durable, 10)
    trace_id = parent.get_span_context().trace_id
    consumers = [s for s in exporter.get_finished_spans()
                 if s.kind is trace.SpanKind.CONSUMER and s.name.startswith("event ")
                 and s.context.trace_id == trace_id]
    assert len(consumers) >= 2, [(s.name, s.context.trace_id) for s in
                                 exporter.get_finished_spans()]
    server = next(s for s in exporter.get_finished_spans() if s.name == "models.create"
                  and s.context.trace_id == trace_id)
    assert all(s.parent is not None and s.parent.span_id == server.context.span_id
               for s in consumers)
