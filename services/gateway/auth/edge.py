"""The gateway's first middleware, ahead of tracing and of the error middleware: it refuses a
request that must not reach anything else (edge_rules.py says which: header bytes, the Host,
cross-origin browsers), answering in OpenAI's shape itself since no other middleware has run
yet. The Host names it allows are fixed when the app is built (`allowed_hosts`)."""

from __future__ import annotations

import socket

from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.services.gateway.auth.edge_rules import check_header_text, check_host, check_origin
from shoal.services.gateway.errors import error_response
from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError

ALLOWED_HOSTS: web.AppKey[frozenset[str]] = web.AppKey("shoal_allowed_hosts", frozenset)
ANY_HOST_PATHS = frozenset({"/health"})
"""Liveness probes may use any name; the answer holds nothing."""


def allowed_hosts(settings: Settings) -> frozenset[str]:
    """The names a request's Host may carry (IP addresses always pass): localhost, this
    machine's name (short and fully qualified), the bind and advertised addresses, and
    SHOAL_GATEWAY_ALLOWED_HOSTS."""
    names = {"localhost", socket.gethostname(), socket.getfqdn(), settings.gateway_host,
             settings.metrics_advertise_host or "", *settings.gateway_allowed_hosts.split(",")}
    return frozenset(n.strip().lower().rstrip(".") for n in names if n and n.strip())


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        check_header_text(request.headers.items())
        if request.path not in ANY_HOST_PATHS:
            check_host(request.headers.get("Host"), request.app[ALLOWED_HOSTS])
        check_origin(request.method, request.path, request.headers.get("Sec-Fetch-Site"),
                     request.headers.get("Origin"), request.headers.get("Host"))
    except ShoalError as exc:
        return error_response(exc)
    return await handler(request)


def install(app: web.Application, settings: Settings) -> None:
    """Put the edge first. The tracing instrumentation puts its own middleware first when the
    app is built (it wraps web.Application), so this goes in after, before the app freezes."""
    app[ALLOWED_HOSTS] = allowed_hosts(settings)
    app.middlewares.insert(0, edge_middleware)
