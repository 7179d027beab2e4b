"""Embeddings and scores through a backend: an EmbedRequest from the bus as the backend's
`/v1/embeddings` body, and its answer as our EmbedReply (base64 of float32 little-endian rows, as
our embedding engine sends them); a ScoreRequest as vLLM's `/v1/score` body (the pairs as two
lists of one length), and its answer as our ScoreReply. Pure; the adapter (proxy.py) does the
HTTP.

The vectors are asked for as floats: every OpenAI-compatible server has that encoding (vLLM,
llama.cpp's `llama-server --embeddings`, another Shoal); an answer in base64 anyway is read too.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from shoal.shared.schemas.backends import find_flag, flatten_parameters
from shoal.shared.schemas.infer import EmbedReply, EmbedRequest, ScoreReply, ScoreRequest


def serves_embeddings(parameters: list[str]) -> bool:
    """vLLM's flags that make a model an embedder: `--runner pooling` (0.10 on), `--convert
    embed`, or the older `--task embed`."""
    tokens = flatten_parameters(parameters)
    return (find_flag(tokens, "runner") == "pooling" or find_flag(tokens, "convert") == "embed"
            or find_flag(tokens, "task") in ("embed", "embedding"))


def embedding_body(req: EmbedRequest, served_name: str) -> dict[str, Any]:
    body: dict[str, Any] = {"model": served_name, "encoding_format": "float",
                            "input": req.texts if req.texts is not None else req.token_ids}
    if req.dimensions is not None:
        body["dimensions"] = req.dimensions
    if req.truncate_prompt_tokens is not None:
        body["truncate_prompt_tokens"] = req.truncate_prompt_tokens  # vLLM's extra
    return body


def embed_reply(answer: dict[str, Any]) -> EmbedReply:
    """The backend's answer, rows in input order; ValueError when it is not an embeddings list
    of one width."""
    items = answer.get("data")
    if not isinstance(items, list) or not items:
        raise ValueError("the backend's answer has no embeddings")
    rows = [_row(item.get("embedding")) for item in sorted(items, key=lambda i: i.get("index", 0))]
    width = len(rows[0])
    if any(len(r) != width for r in rows):
        raise ValueError("the backend's embeddings differ in width")
    flat = [x for row in rows for x in row]
    data = base64.b64encode(struct.pack(f"<{len(flat)}f", *flat)).decode()
    usage = answer.get("usage") or {}
    return EmbedReply(data=data, num_inputs=len(rows), dimensions=width,
                      prompt_tokens=int(usage.get("prompt_tokens") or 0))


def _row(embedding: object) -> list[float]:
    if isinstance(embedding, str):  # base64 of float32 little-endian, as OpenAI's option
        raw = base64.b64decode(embedding)
        return list(struct.unpack(f"<{len(raw) // 4}f", raw))
    if not isinstance(embedding, list):
        raise ValueError("an embedding is neither a list of numbers nor base64")
    return [float(x) for x in embedding]


def score_body(req: ScoreRequest, served_name: str) -> dict[str, Any]:
    """vLLM's /v1/score pairs two lists of one length element by element (rerank is the same
    pairs with the query repeated, so only /v1/score is asked)."""
    body: dict[str, Any] = {"model": served_name, "text_1": req.text_1, "text_2": req.text_2}
    if req.truncate_prompt_tokens is not None:
        body["truncate_prompt_tokens"] = req.truncate_prompt_tokens
    return body


def score_reply(answer: dict[str, Any], pairs: int) -> ScoreReply:
    """The backend's scores in pair order; ValueError when it is not one score per pair."""
    items = answer.get("data")
    if not isinstance(items, list) or len(items) != pairs:
        raise ValueError(f"the backend's answer has not {pairs} scores")
    scores = [float(item["score"]) for item in sorted(items, key=lambda i: i.get("index", 0))]
    usage = answer.get("usage") or {}
    return ScoreReply(scores=scores, prompt_tokens=int(usage.get("prompt_tokens") or 0))
