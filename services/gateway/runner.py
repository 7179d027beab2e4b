"""The gateway's aiohttp runner: errors that aiohttp's HTTP server makes itself, before any
route or middleware runs (a malformed request line or header, a header with a bare line feed,
a handler failure that escaped the middlewares), leave in OpenAI's JSON shape too, and are
logged without the request's bytes.

aiohttp answers those in `RequestHandler.handle_error` with a text/plain body and logs the
parser's exception at ERROR, whose message quotes the raw header, bearer secret included
(issue 15). Here the answer is `{"error": {...}}` with the same status, and the log line names
only the status and the exception's type.
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

log = logging.getLogger(__name__)
_MESSAGES = {400: "malformed HTTP request (request line or headers)",
             413: "request headers too large", 431: "request headers too large",
             500: "internal error"}


def server_error_body(status: int) -> dict[str, dict[str, str | None]]:
    """The OpenAI-shaped body for an error aiohttp's server made (pure, unit tested)."""
    client_side = status < 500
    return {"error": {"message": _MESSAGES.get(status, "malformed HTTP request"),
                      "type": "invalid_request_error" if client_side else "internal_error",
                      "param": None,
                      "code": "bad_http_request" if client_side else "internal_error"}}


class _JsonErrorHandler(RequestHandler):
    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        # the exception's text and traceback may hold raw request bytes: never logged
        log.info("HTTP %d from the server itself for %s (%s)", status, request.remote,
                    type(exc).__name__ if exc is not None else "no exception")
        if request.writer.output_size > 0:
            raise ConnectionError("response already started; cannot send the error")
        response = web.json_response(server_error_body(status), status=status)
        response.force_close()
        return response


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """An AppRunner whose protocol answers its own errors as OpenAI-shaped JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # same state; only the handler class differs
        return server
