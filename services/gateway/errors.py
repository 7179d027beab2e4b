"""Error middleware: every failure leaves as OpenAI-shaped JSON with the right status.

ShoalError kinds keep their status; aiohttp's HTTP errors (unknown route, wrong method, body too
large) get OpenAI's shape too; anything unexpected is logged and answered 500 without internals.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from shoal.services.gateway.anthropic.answer import error_body as anthropic_error
from shoal.shared.errors import InvalidRequest, PayloadTooLarge, RateLimited, ShoalError

log = logging.getLogger(__name__)
ANTHROPIC_PREFIX = "/v1/messages"


def is_anthropic(path: str) -> bool:
    """Anthropic's Messages routes, whose errors are Anthropic-shaped."""
    return path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/")

_TYPE_BY_STATUS = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error",
                   404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
                   413: "invalid_request_error", 429: "rate_limit_error",
                   503: "service_unavailable"}


def error_body(exc: BaseException) -> tuple[int, dict[str, Any]]:
    """(status, {"error": {...}}) for any exception; pure, so it is unit tested directly."""
    if isinstance(exc, ShoalError):
        return exc.http_status, {"error": exc.to_dict()}
    if isinstance(exc, web.HTTPException) and exc.status >= 400:
        message = {404: "no such route", 405: "method not allowed",
                   413: "request body too large"}.get(exc.status, exc.reason)
        return exc.status, {"error": {"message": message,
                                      "type": _TYPE_BY_STATUS.get(exc.status, "error"),
                                      "param": None, "code": None}}
    return 500, {"error": {"message": "internal error", "type": "internal_error", "param": None,
                           "code": "internal_error"}}


def error_response(exc: BaseException, anthropic: bool = False) -> web.Response:
    """The error's answer; on Anthropic's routes in Anthropic's shape, statuses unchanged."""
    status, body = error_body(exc)
    if anthropic:
        body = anthropic_error(status, body["error"]["message"]).body()
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    if isinstance(exc, RateLimited):  # a key's limit: when it resets, and OpenAI's headers
        headers = dict(exc.headers)
        if exc.retry_after is not None:
            headers["Retry-After"] = str(max(1, math.ceil(exc.retry_after)))
    return web.json_response(body, status=status, headers=headers or None)


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    anthropic = is_anthropic(request.path)
    try:
        return await handler(request)
    except ShoalError as exc:
        if exc.http_status >= 500:
            log.warning("%s %s: %s", request.method, request.path, exc.message)
        return error_response(exc, anthropic)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error_response(exc, anthropic)
    except asyncio.CancelledError:
        raise
    except (TimeoutError, ConnectionResetError) as exc:
        log.info("%s %s: client went away (%s)", request.method, request.path, type(exc).__name__)
        raise
    except Exception:
        log.exception("unexpected error on %s %s", request.method, request.path)
        return error_response(RuntimeError(), anthropic)


def _is_json(content_type: str) -> bool:
    mime = content_type.partition(";")[0].strip().lower()
    return mime == "application/json" or (mime.startswith("application/") and
                                          mime.endswith("+json"))


async def read_body(request: web.Request) -> bytes:
    """The raw JSON body. A body sent as another media type (text/plain, a form), or with no
    Content-Type at all, is a 400: OpenAI clients always send application/json, and a browser
    sends a body without preflight only as text/plain, a form or with no type (issue 24: a
    cross-site `fetch(..., {mode: "no-cors", body: blob})` deployed a model). Larger than the
    gateway's limit is a 413 (README "The largest request"); never a 500."""
    content_type = request.headers.get("Content-Type")
    if content_type is None or not _is_json(content_type):
        got = "none" if content_type is None else repr(content_type[:80])
        raise InvalidRequest(f"Content-Type must be application/json, got {got}",
                             param="Content-Type", code="invalid_content_type")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise PayloadTooLarge(f"the body is larger than {request.client_max_size} bytes, the "
                              "largest request this gateway reads") from exc

