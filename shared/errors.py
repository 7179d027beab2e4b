"""ShoalError and its kinds: one error vocabulary from the engine to the HTTP edge.

Each kind carries an OpenAI-style `type`, a stable `code` and the HTTP status the gateway
answers with. The bus adapter turns them into `{"error": {...}}` replies and back, so an error
raised in the registry or an engine reaches the client unchanged (docs/architecture.md "Errors").
"""

from __future__ import annotations

from typing import Any, ClassVar


class ShoalError(Exception):
    http_status: ClassVar[int] = 500
    type: ClassVar[str] = "internal_error"
    code: ClassVar[str] = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        if code is not None:
            self.code = code  # type: ignore[misc]

    def to_dict(self) -> dict[str, Any]:
        """The body of an OpenAI-style error: {"message", "type", "param", "code"}."""
        return {"message": self.message, "type": self.type, "param": self.param, "code": self.code}

    @classmethod
    def from_dict(cls, body: dict[str, Any], status: int | None = None) -> ShoalError:
        """Rebuild the right kind from an error body (received over the bus)."""
        kind = _BY_TYPE.get(str(body.get("type", "")))
        if status is not None and (kind is None or kind.http_status != status):
            kind = _BY_STATUS.get(status, kind)  # the status decides: 400 and 413 share a type
        kind = kind or ShoalError
        return kind(str(body.get("message", "unknown error")), param=body.get("param"),
                    code=body.get("code"))


class InvalidRequest(ShoalError):
    http_status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class PayloadTooLarge(InvalidRequest):
    """A request (or its answer) larger than Shoal carries: the gateway's body limit or the
    NATS server's max_payload (README "The largest request")."""

    http_status = 413
    code = "request_too_large"


class Unauthorized(ShoalError):
    http_status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class Forbidden(ShoalError):
    """A valid key without the scope the route needs (an inference key on the management API)."""

    http_status = 403
    type = "permission_error"
    code = "insufficient_scope"


class NotFound(ShoalError):
    http_status = 404
    type = "not_found_error"
    code = "not_found"


class Conflict(ShoalError):
    """A stale version or an illegal state transition: nothing was written."""

    http_status = 409
    type = "conflict_error"
    code = "conflict"


class Overloaded(ShoalError):
    http_status = 429
    type = "rate_limit_error"
    code = "overloaded"


class RateLimited(ShoalError):
    """A key over one of its limits (OpenAI's shape: type "requests" or "tokens", code
    rate_limit_exceeded; a spent budget: type and code insufficient_quota). `retry_after`
    seconds become the Retry-After header."""

    http_status = 429
    type = "requests"
    code = "rate_limit_exceeded"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 kind: str | None = None, retry_after: float | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message, param=param, code=code)
        if kind is not None:
            self.type = kind  # type: ignore[misc]
        self.retry_after = retry_after
        self.headers = headers or {}


class Unavailable(ShoalError):
    """No instance can serve now, or an engine died mid-request."""

    http_status = 503
    type = "service_unavailable"
    code = "unavailable"


class Timeout(ShoalError):
    """A service did not answer in time (it may be restarting): a 503 with Retry-After, as
    for any other component that is away, so clients retry rather than give up."""

    http_status = 503
    type = "timeout_error"
    code = "timeout"


_KINDS: list[type[ShoalError]] = [InvalidRequest, Unauthorized, Forbidden, NotFound, Conflict,
                                  Overloaded, Unavailable, Timeout]
_BY_TYPE: dict[str, type[ShoalError]] = {k.type: k for k in _KINDS}
_BY_STATUS: dict[int, type[ShoalError]] = {k.http_status: k for k in [*_KINDS, PayloadTooLarge]
                                           if k is not Timeout}
"""An error of unknown type by its status; 503 is Unavailable (Timeout shares its status)."""
