"""The gateway's spans. aiohttp's OpenTelemetry instrumentation makes the HTTP SERVER span of
every request (HTTP semantic conventions, parented by the client's `traceparent`); inside it,
one span per OpenAI inference carries the GenAI conventions (shared/genai.py). Its context rides
to the engine in the NATS headers of the generate request.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from opentelemetry import trace
from opentelemetry.instrumentation.aiohttp_server import AioHttpServerInstrumentor

from shoal.services.gateway.openai.responses import ResponseBuilder
from shoal.shared.genai import (
    Attributes, operation_name, pooling_attributes, pooling_result_attributes, request_attributes,
    response_attributes
)
from shoal.shared.schemas.infer import GenerateRequest
from shoal.shared.telemetry import get_tracer

UNTRACED_PATHS = "/metrics,/health,/version"
"""Scrapes and probes: a span each would drown the traces that matter."""


def instrument_http() -> None:
    """Install aiohttp's server instrumentation once per process (it wraps web.Application, so
    call it before the app is built). The library reads its excluded paths from the
    environment only; ours are the default unless the operator set their own."""
    os.environ.setdefault("OTEL_PYTHON_AIOHTTP_SERVER_EXCLUDED_URLS", UNTRACED_PATHS)
    instrumentor = AioHttpServerInstrumentor()
    if not instrumentor.is_instrumented_by_opentelemetry:
        instrumentor.instrument()


@contextmanager
def inference_span(req: GenerateRequest, builder: ResponseBuilder[Any],
                   stream: bool) -> Iterator[trace.Span]:
    """The span of one OpenAI inference, named "{operation} {model}" as GenAI spans are; the
    response's id, usage and finish reasons are added when it ends well."""
    name = f"{operation_name(req)} {req.model}"
    with get_tracer("shoal.gateway").start_as_current_span(
            name, kind=trace.SpanKind.INTERNAL,
            attributes=request_attributes(req, stream)) as span:
        yield span
        reasons = [c.finish_reason for _, c in sorted(builder.choices.items()) if c.finish_reason]
        span.set_attributes(response_attributes(builder.usage, reasons, builder.id, builder.model))


@contextmanager
def pooling_span(operation: str, model: str, inputs: int, **request: Any
                 ) -> Iterator[Callable[[int], None]]:
    """The span of one embeddings, score or rerank request ("{operation} {model}"), parent of
    its batches' bus requests; yields `done(input_tokens)`, called when the replies are in."""
    attrs: Attributes = pooling_attributes(operation, model, inputs, **request)
    with get_tracer("shoal.gateway").start_as_current_span(
            f"{operation} {model}", kind=trace.SpanKind.INTERNAL, attributes=attrs) as span:
        yield lambda tokens: span.set_attributes(pooling_result_attributes(tokens, model))
