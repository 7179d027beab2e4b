"""Stored answers of OpenAI's Responses API (`store: true`): what a later request's
`previous_response_id` continues from, kept in Postgres so it outlives any gateway or registry.
A stored response belongs to the key that created it (None: no Shoal key); another key sees it
as not found."""

from __future__ import annotations

from typing import Any

from pydantic import Field

from shoal.shared.schemas.common import Wire

RESPONSE_ID_PATTERN = r"^resp_[A-Za-z0-9]{1,60}$"


class StoredResponse(Wire):
    id: str = Field(pattern=RESPONSE_ID_PATTERN)
    key_id: str | None = None
    model: str
    previous_response_id: str | None = None
    conversation: list[dict[str, Any]]
    """The chat messages of the whole conversation, its output last (instructions are not
    carried over, as OpenAI does not carry them over either)."""
    response: dict[str, Any]
    """The Response object as the client received it (GET answers it)."""


class ResponseRef(Wire):
    id: str = Field(min_length=1, max_length=100)
    key_id: str | None = None
    """The key asking: a response of another key is not found."""
