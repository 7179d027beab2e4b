"""A thin typed layer over nats.micro: `await svc.endpoint(resource, verb, Req, handler)`.

The error policy lives here, in one place (as micro's Endpoint does): a body that does not parse
is an InvalidRequest (400); a ShoalError becomes `{"error": {...}}` with the micro error headers
(code = HTTP status); anything else is logged and answered as a 500 — and the service keeps
serving. Discovery ($SRV.PING/INFO/STATS) comes from nats.micro.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.micro
from nats.micro.request import Request
from nats.micro.service import Service
from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Histogram
from pydantic import BaseModel

from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import decode, error_body, error_headers
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.metrics import TTFT_BUCKETS as LATENCY_BUCKETS
from shoal.shared.telemetry import extract_context, get_tracer

log = logging.getLogger(__name__)

Req = TypeVar("Req", bound=BaseModel)
NUL = b"\\u0000"
"""A NUL as pydantic writes it in JSON. Postgres text cannot store one and a path cannot hold one
(os.stat raises), so a request carrying one is a 400 here, not a DBAPIError (500) deeper in."""
Handler = Callable[[Req], Awaitable[BaseModel]]


class RpcService:
    """One micro service; endpoints are served as <group>.<resource>.<verb>. `name` (e.g.
    shoal-registry) labels its metrics; on NATS it is namespaced (`Subjects.service`)."""

    def __init__(self, bus: Bus, name: str, version: str, group: str,
                 description: str = "", metrics: CollectorRegistry | None = None,
                 translate: Callable[[BaseException], ShoalError | None] | None = None) -> None:
        """`translate` turns an unexpected exception into the error to answer (the registry:
        a lost database is a 503, not a 500), and reports it (the registry rate-limits those
        lines); None leaves it a 500, logged with its traceback."""
        self.bus = bus
        self.translate = translate
        self.name = name
        self.version = version
        self.group = group
        self.description = description
        self._service: Service | None = None
        self._tracer = get_tracer(name)
        self._latency = Histogram(
            "shoal:bus_request_duration_seconds", "Time to answer a request, by endpoint.",
            ["service", "endpoint"], buckets=LATENCY_BUCKETS,
            registry=metrics) if metrics is not None else None
        self._errors = Counter(
            "shoal:bus_request_errors", "Requests answered with an error, by endpoint and code.",
            ["service", "endpoint", "code"], registry=metrics) if metrics is not None else None

    async def start(self) -> None:
        self._service = await nats.micro.add_service(
            self.bus.nc, name=self.bus.subjects.service(self.name), version=self.version,
            description=self.description, queue_group=self.bus.subjects.service(self.name),
        )

    async def stop(self) -> None:
        if self._service is not None:
            await self._service.stop()
            self._service = None

    async def endpoint(self, resource: str, verb: str, request_type: type[Req],
                       handler: Handler[Req]) -> None:
        assert self._service is not None, "start() the service first"
        group = self._service.add_group(name=f"{self.group}.{resource}")
        await group.add_endpoint(name=verb,
                                 handler=self._wrap(f"{resource}.{verb}", request_type, handler))

    def _wrap(self, name: str, request_type: type[Req],
              handler: Handler[Req]) -> Callable[[Request], Awaitable[None]]:
        async def handle(request: Request) -> None:
            start = time.perf_counter()
            with self._tracer.start_as_current_span(
                name, context=extract_context(request.headers), kind=trace.SpanKind.SERVER
            ) as span:
                try:
                    if NUL in request.data:
                        raise InvalidRequest("text must not contain NUL characters (\\u0000): "
                                             "no name, id, path or label holds one")
                    reply = await handler(decode(request.data, request_type))
                except ShoalError as exc:
                    span.set_attribute("shoal.error", exc.code)
                    await respond_error(request, exc)
                    self._observe(name, start, str(exc.http_status))
                    return
                except Exception as exc:  # noqa: BLE001 - answer, log, keep serving
                    known = self.translate(exc) if self.translate is not None else None
                    if known is not None:
                        log.debug("%s failed: %s", name, known.message)
                        await respond_error(request, known)
                        self._observe(name, start, str(known.http_status))
                        return
                    log.exception("%s failed", name)
                    span.record_exception(exc)
                    error = ShoalError(f"internal error in {name}: {type(exc).__name__}")
                    await respond_error(request, error)
                    self._observe(name, start, "500")
                    return
                await request.respond(reply.model_dump_json().encode())
                self._observe(name, start, None)

        return handle

    def _observe(self, endpoint: str, start: float, error_code: str | None) -> None:
        if self._latency is not None:
            self._latency.labels(self.name, endpoint).observe(time.perf_counter() - start)
        if self._errors is not None and error_code is not None:
            self._errors.labels(self.name, endpoint, error_code).inc()


async def respond_error(request: Request, exc: ShoalError) -> None:
    await request.respond(error_body(exc), headers=error_headers(exc))
