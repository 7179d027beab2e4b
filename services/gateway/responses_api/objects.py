"""The Responses API's answers as pydantic models (pure), for /openapi.json: the Response object
(answer.py builds it, field for field as the openai SDK's `Response`), a streamed event, and
what DELETE answers."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseObject(BaseModel):
    model_config = ConfigDict(extra="allow")

    id: str
    object: Literal["response"] = "response"
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[dict[str, Any]]
    """`message` items (`output_text` content) and `function_call` items."""
    instructions: str | None
    previous_response_id: str | None
    store: bool
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    usage: ResponseUsage | None


class ResponseStreamEvent(BaseModel):
    """One `event: <type>` of a stream; `data` has `type` and `sequence_number` and, by type,
    `response`, `item`, `part`, `delta`, `text`, `arguments`, `output_index`, `item_id`."""

    model_config = ConfigDict(extra="allow")

    type: str
    sequence_number: int


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response"] = "response"
    deleted: bool
