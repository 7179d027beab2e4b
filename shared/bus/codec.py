"""The bus's wire format: a pydantic model to bytes and back (a malformed payload is an
InvalidRequest naming the field), and a ShoalError as a reply (the micro error headers and an
ErrorReply body) and back, so an error raised in one service reaches the caller unchanged."""

from __future__ import annotations

from typing import TypeVar

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from shoal.shared.errors import InvalidRequest, PayloadTooLarge, ShoalError
from shoal.shared.schemas.common import ErrorReply

T = TypeVar("T", bound=BaseModel)
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"


def encode(payload: BaseModel) -> bytes:
    """A partial update (a model with `partial = True`, e.g. ModelUpdate) sends only the fields
    that were set, so the receiver can tell "leave as is" from "set to null"."""
    partial = bool(getattr(payload, "partial", False))
    return payload.model_dump_json(exclude_unset=partial).encode()


def decode(data: bytes, model: type[T]) -> T:
    """Parse a payload; a malformed one is an InvalidRequest naming what is wrong."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        raise refusal(exc, f"malformed {model.__name__}: ", "body") from None


def refusal(exc: ValidationError, prefix: str = "", whole: str = "body") -> InvalidRequest:
    """pydantic's first complaint as a 400 naming its field (`whole` when it is about the
    object as a whole, e.g. fields that do not fit together)."""
    first = exc.errors()[0]
    where = ".".join(str(p) for p in first.get("loc", ())) or None
    return InvalidRequest(f"{prefix}{where or whole}: {first['msg']}", param=where)


def too_large(nc: NATS, data: bytes, what: str = "the request") -> PayloadTooLarge:
    """Why a message cannot go on the bus: the server's max_payload (README "The largest
    request"), so the client gets a 413, not a 500."""
    return PayloadTooLarge(f"{what} is {len(data)} bytes on the bus; the NATS server "
                           f"carries at most {nc.max_payload} bytes (its max_payload)")


def raise_for_error(msg: Msg) -> None:
    """Raise the ShoalError carried by an error reply (micro error headers + ErrorReply body)."""
    code = (msg.headers or {}).get(ERROR_CODE_HEADER)
    if code is None:
        return
    try:
        body = ErrorReply.model_validate_json(msg.data).error.model_dump()
    except ValidationError:
        body = {"message": (msg.headers or {}).get(ERROR_HEADER, "error"), "type": ""}
    raise ShoalError.from_dict(body, status=int(code) if code.isdigit() else None)


def error_body(exc: ShoalError) -> bytes:
    return ErrorReply.model_validate({"error": exc.to_dict()}).model_dump_json().encode()


def error_headers(exc: ShoalError) -> dict[str, str]:
    return {ERROR_CODE_HEADER: str(exc.http_status), ERROR_HEADER: exc.message[:200]}
