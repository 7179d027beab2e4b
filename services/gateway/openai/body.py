"""Body: the base of every HTTP request body model (pure). Unknown fields are ignored, as
OpenAI's and vLLM's servers do: clients send vendor extras that must not become 400s. Known
fields are strict, as OpenAI's are: `"seed": "42"` or `"n": 2.0` is a 400, never coerced."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

MAX_INT32 = 2**31 - 1
TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]
"""A token id as requests give it: bounded, so no id overflows an engine's int64 tensors."""


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
