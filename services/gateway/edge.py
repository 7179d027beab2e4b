"""The gateway's first middleware, ahead of tracing and of the error middleware: it refuses a
request that must not reach anything else (edge_rules.py says which), answering in OpenAI's
shape itself since no other middleware has run yet."""

from __future__ import annotations

from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.services.gateway.edge_rules import check_header_text
from shoal.services.gateway.errors import error_response
from shoal.shared.errors import ShoalError


@web.middleware
async def edge_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        check_header_text(request.headers.items())
    except ShoalError as exc:
        return error_response(exc)
    return await handler(request)


def install(app: web.Application) -> None:
    """Put the edge first. The tracing instrumentation puts its own middleware first when the
    app is built (it wraps web.Application), so this goes in after, before the app freezes."""
    app.middlewares.insert(0, edge_middleware)
