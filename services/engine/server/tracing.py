"""The engine's spans of one generate request, in the trace the gateway started: a SERVER span
parented by the `traceparent` in the request's NATS headers (GenAI request and usage attributes,
and vLLM's gen_ai.latency.* figures), and under it the request's phases as spans of their own,
drawn afterwards from the engine's timestamps (RequestMetrics): `queue` (arrival -> first
scheduled), `prefill` (-> first token), `decode` (-> last token). Drawing them after the fact
keeps tracing out of the engine's stepping thread.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace

from shoal.services.engine.core.request_output import RequestMetrics
from shoal.shared.genai import request_attributes, response_attributes
from shoal.shared.schemas.infer import GenerateRequest, Usage
from shoal.shared.telemetry import extract_context, get_tracer

_tracer = get_tracer("shoal.engine")


@contextmanager
def generate_span(req: GenerateRequest, headers: Mapping[str, str] | None, subject: str,
                  instance_id: str) -> Iterator[trace.Span]:
    attributes = {**request_attributes(req), "messaging.system": "nats",
                  "messaging.destination.name": subject, "shoal.instance_id": instance_id}
    with _tracer.start_as_current_span(f"generate {req.model}", context=extract_context(headers),
                                       kind=trace.SpanKind.SERVER,
                                       attributes=attributes) as span:
        yield span


def record_finished(span: trace.Span, m: RequestMetrics, usage: Usage,
                    finish_reasons: list[str]) -> None:
    """Usage, finish reasons and latencies on the request's span, and its phases as children."""
    span.set_attributes(response_attributes(usage, finish_reasons))
    if m.first_token_time is not None:
        span.set_attribute("gen_ai.latency.time_to_first_token",
                           m.first_token_time - m.arrival_time)
    if m.first_scheduled_time is not None:
        span.set_attribute("gen_ai.latency.time_in_queue", m.first_scheduled_time - m.arrival_time)
    if m.last_token_time is not None:
        span.set_attribute("gen_ai.latency.e2e", m.last_token_time - m.arrival_time)
    parent = trace.set_span_in_context(span)
    phases = (("queue", m.arrival_time, m.first_scheduled_time),
              ("prefill", m.first_scheduled_time, m.first_token_time),
              ("decode", m.first_token_time, m.last_token_time))
    for name, start, end in phases:
        if start is not None and end is not None:
            _tracer.start_span(name, context=parent, start_time=_ns(start)).end(end_time=_ns(end))


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)
