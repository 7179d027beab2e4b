"""Body: the base of every HTTP request body model (pure). Unknown fields are ignored, as
OpenAI's and vLLM's servers do: clients send vendor extras that must not become 400s."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
