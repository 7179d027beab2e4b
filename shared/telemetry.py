"""Tracing: an OpenTelemetry tracer per service whose W3C context rides in NATS headers, so one
trace follows a request from the client's `traceparent` through the gateway, the bus and the
engine.

`setup_tracing` installs the process's provider with its exporter (SHOAL_OTEL_EXPORTER):
`none`, `console`, or `otlp`, configured by the standard OTEL_EXPORTER_OTLP_* variables as
vLLM's --otlp-traces-endpoint is (endpoint; protocol `grpc`, the default, or `http/protobuf`).
`inject_headers` puts the current span's `traceparent` into a header dict before a publish or
request; `extract_context` reads it back on the receiving side.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shoal.shared.version import VERSION

_PROPAGATOR = TraceContextTextMapPropagator()
EXPORTERS = ("none", "console", "otlp")
OTLP_PROTOCOLS = ("grpc", "http/protobuf")


def otlp_exporter(environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The OTLP span exporter the standard variables ask for (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL,
    else OTEL_EXPORTER_OTLP_PROTOCOL; default grpc). The exporters read their endpoint, headers
    and timeout from the same variables themselves."""
    protocol = (environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
                or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").strip()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter()
    raise ValueError(f"OTEL_EXPORTER_OTLP_PROTOCOL must be one of {', '.join(OTLP_PROTOCOLS)}, "
                     f"got {protocol!r}")


def setup_tracing(service_name: str, exporter: str = "none") -> None:
    """Install the process's tracer provider (once, at the process edge). An unknown exporter
    is an error here, at start, not spans silently lost later."""
    if exporter not in EXPORTERS:
        raise ValueError(f"SHOAL_OTEL_EXPORTER must be one of {', '.join(EXPORTERS)}, "
                         f"got {exporter!r}")
    if isinstance(trace.get_tracer_provider(), TracerProvider):
        return
    provider = TracerProvider(resource=Resource.create({"service.name": service_name,
                                                        "service.version": VERSION}))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        provider.add_span_processor(BatchSpanProcessor(otlp_exporter()))
    trace.set_tracer_provider(provider)


def shutdown_tracing() -> None:
    """Export what is still batched (at process exit)."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


def get_tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name, VERSION)


def inject_headers(headers: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `headers` with the current trace context (traceparent, tracestate) added."""
    carrier = dict(headers or {})
    _PROPAGATOR.inject(carrier)
    return carrier


def extract_context(headers: Mapping[str, str] | None) -> otel_context.Context:
    return _PROPAGATOR.extract(dict(headers or {}))


@contextlib.contextmanager
def event_span(subject: str, headers: Mapping[str, str] | None) -> Iterator[None]:
    """A CONSUMER span around handling a message that carries a trace context (an event of a
    traced call: the registry's outbox keeps it); nothing for the many messages that carry none
    (engine loads, heartbeats)."""
    if not headers or "traceparent" not in headers:
        yield
        return
    with get_tracer("shoal.bus").start_as_current_span(
            f"event {subject}", context=extract_context(headers), kind=trace.SpanKind.CONSUMER):
        yield
