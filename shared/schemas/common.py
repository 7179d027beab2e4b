"""Wire basics shared by every message: the strict base model, error replies, pages."""

from __future__ import annotations

from datetime import datetime, UTC
from typing import Generic, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class Wire(BaseModel):
    """Base of every bus payload: unknown fields are refused, so a typo is an error, not a no-op.
    Field docstrings become the fields' descriptions in JSON schemas (/openapi.json, the
    dashboard's deploy form)."""

    model_config = ConfigDict(extra="forbid", frozen=False, use_attribute_docstrings=True)


class ErrorBody(Wire):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorReply(Wire):
    error: ErrorBody


class Page(Wire, Generic[T]):
    items: list[T]
    total: int


class Empty(Wire):
    """A request or reply with no fields."""


def utcnow() -> datetime:
    return datetime.now(UTC)
