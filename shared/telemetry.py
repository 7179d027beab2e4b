"""Tracing: an OpenTelemetry tracer per service whose W3C context rides in NATS headers.

`inject_headers` puts the current span's `traceparent` into a header dict before a publish or
request; `extract_context` reads it back on the receiving side, so one trace covers
gateway -> registry -> engine.
"""

from __future__ import annotations

from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SimpleSpanProcessor
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_PROPAGATOR = TraceContextTextMapPropagator()


def setup_tracing(service_name: str, exporter: str = "none") -> None:
    """Install the process's tracer provider (once, at the process edge)."""
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    trace.set_tracer_provider(provider)


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject_headers(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `headers` with the current trace context (traceparent, tracestate) added."""
    carrier = dict(headers or {})
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(headers or {}))
