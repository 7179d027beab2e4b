"""The registry API's generic requests and replies (by id, by name, delete, list pages) and the
pattern every name of a model, alias, worker or key follows."""

from __future__ import annotations

from pydantic import Field

from shoal.shared.schemas.common import Wire

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,62}$"


class ById(Wire):
    id: str


class ByIdOrName(Wire):
    id: str | None = None
    name: str | None = None


class DeleteRequest(Wire):
    id: str
    version: int | None = None
    """When given, refused if the row changed since (optimistic)."""



class Deleted(Wire):
    id: str
    deleted: bool = True


class ListRequest(Wire):
    limit: int = Field(default=1000, ge=1, le=10000)
    offset: int = Field(default=0, ge=0)
