"""/v1/embeddings (OpenAI's API, pure): the body, its split into bus-sized batches, and the
answer built from the engines' replies.

Input is a string, a list of strings, a list of token ids or a list of them (OpenAI's four
forms); token ids go to the engine as given (no special tokens added), texts are tokenized
there. A long list is split into batches of at most `BATCH_INPUTS` inputs (and about
`BATCH_TEXT_BYTES` of text) so every bus message stays far below NATS' 1 MiB payload, and the
batches go to the model's instances in parallel. Vectors travel as base64 float32 and are handed
out as is for `encoding_format=base64` (what the openai SDK asks for by default).
"""

from __future__ import annotations

import base64
import struct
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from shoal.services.gateway.openai.body import Body, TokenId
from shoal.services.gateway.openai.objects import OpenAIObject
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import EmbedReply, EmbedRequest


class Embedding(OpenAIObject):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str
    """The vector, or its float32 bytes in base64 (`encoding_format: "base64"`)."""


class EmbeddingUsage(OpenAIObject):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


MAX_INPUTS = 2048
"""OpenAI's limit on inputs per request."""
BATCH_INPUTS = 64
BATCH_TEXT_BYTES = 256 * 1024


class EmbeddingBody(Body):
    model: str = Field(min_length=1)
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM's extra: keep at most this many tokens of each input (-1: the model's limit)."""

    def check(self) -> None:
        """Called by parse_body: a 400 naming `input` for an empty or oversized input."""
        items = self.inputs()
        if not items:
            raise InvalidRequest("input must not be empty", param="input")
        if len(items) > MAX_INPUTS:
            raise InvalidRequest(f"at most {MAX_INPUTS} inputs per request, got {len(items)}",
                                 param="input")
        for i, item in enumerate(items):
            if not item:
                raise InvalidRequest(f"input {i} is empty", param="input")
            if isinstance(item, list) and any(t < 0 for t in item):
                raise InvalidRequest(f"input {i}: token ids must be >= 0", param="input")

    def inputs(self) -> list[str] | list[list[int]]:
        """The input as a list of texts or a list of token-id lists."""
        x = self.input
        if isinstance(x, str):
            return [x]
        if x and isinstance(x[0], int):
            return [x]  # type: ignore[list-item]
        return list(x)  # type: ignore[arg-type]

    def batches(self) -> list[EmbedRequest]:
        """Bus requests of at most BATCH_INPUTS inputs / ~BATCH_TEXT_BYTES of text each."""
        items = self.inputs()
        out: list[EmbedRequest] = []
        start = 0
        while start < len(items):
            end, size = start, 0
            while end < len(items) and end - start < BATCH_INPUTS:
                item = items[end]
                size += len(item.encode()) if isinstance(item, str) else 8 * len(item)
                if end > start and size > BATCH_TEXT_BYTES:
                    break
                end += 1
            part = items[start:end]
            texts = part if isinstance(part[0], str) else None
            out.append(EmbedRequest(model=self.model, texts=texts,  # type: ignore[arg-type]
                                    token_ids=None if texts is not None else part,  # type: ignore[arg-type]
                                    dimensions=self.dimensions,
                                    truncate_prompt_tokens=self.truncate_prompt_tokens))
            start = end
        return out


def rows(reply: EmbedReply) -> list[bytes]:
    """One reply's vectors, row by row, as float32 little-endian bytes."""
    raw = base64.b64decode(reply.data)
    width = reply.dimensions * 4
    if len(raw) != width * reply.num_inputs:
        raise InvalidRequest("malformed embedding reply from the engine")
    return [raw[i * width:(i + 1) * width] for i in range(reply.num_inputs)]


def embedding_response(model: str, replies: Sequence[EmbedReply],
                       encoding_format: str) -> EmbeddingList:
    data: list[Embedding] = []
    for reply in replies:
        for row in rows(reply):
            vector = (base64.b64encode(row).decode() if encoding_format == "base64"
                      else list(struct.unpack(f"<{len(row) // 4}f", row)))
            data.append(Embedding(index=len(data), embedding=vector))
    tokens = sum(r.prompt_tokens for r in replies)
    return EmbeddingList(data=data, model=model,
                         usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))
