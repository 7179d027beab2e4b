"""The pooling routes (vLLM's name for models that answer with vectors or scores, not text):
/v1/embeddings, and vLLM's /v1/score and /v1/rerank for cross-encoders. Each splits its input
into batches sent to the model's instances in parallel, under the key's limits, counts the
prompt tokens as usage, and is counted (shoal:gateway_api_requests) and traced (a GenAI span,
tracing.py pooling_span) as the generation routes are.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from shoal.services.gateway.auth.reservation import prompt_tokens
from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.embeddings import EmbeddingBody, embedding_response
from shoal.services.gateway.openai.score import (
    PairBody, RerankBody, ScoreBody, rerank_response, score_response
)
from shoal.services.gateway.state import STATE
from shoal.services.gateway.tracing import pooling_span
from shoal.shared.logging import log_context
from shoal.shared.schemas.infer import EmbedReply, ScoreReply, Usage

routes = web.RouteTableDef()
R = TypeVar("R", EmbedReply, ScoreReply)


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """Batches of the input go to the model's instances in parallel (embeddings.py)."""
    st = request.app[STATE]
    body = parse_body(await read_body(request), EmbeddingBody)
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    span = {"encoding_format": body.encoding_format, "dimensions": body.dimensions}
    replies = await _pooled(request, body.model, body.batches(), EmbedReply, "input",
                            lambda: sum(prompt_tokens(x) for x in body.inputs()),
                            ("embeddings", len(body.inputs()), span))
    return web.json_response(
        embedding_response(body.model, replies, body.encoding_format).body())


async def _score_pairs(request: web.Request, body: PairBody, api: str, param: str
                       ) -> list[ScoreReply]:
    """A score or rerank body's pairs, answered by the model's instances (see _pooled)."""
    st = request.app[STATE]
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    left, right = body.pairs()
    return await _pooled(request, body.model, body.batches(), ScoreReply, param, lambda: sum(
        prompt_tokens(a) + prompt_tokens(b) for a, b in zip(left, right)), (api, len(left), {}))


async def _pooled(request: web.Request, model: str, batches: list[Any], reply: type[R],
                  param: str, estimate: Callable[[], int],
                  traced: tuple[str, int, dict[str, Any]]) -> list[R]:
    """Each batch is one engine request in flight (what admission counts), all in parallel,
    under the key's limits (`estimate`: the most they may spend, for a key with limits); the
    replies' prompt tokens are the usage, and a failure releases the reservation. `traced`:
    (the API / GenAI operation, how many inputs, the span's request attributes)."""
    st = request.app[STATE]
    api, inputs, attributes = traced
    with st.admission.slot(len(batches), param=param), log_context(model=model):
        ticket = await st.quota.admit(request, model, estimate)
        st.metrics.api_requests.labels(api, model).inc()
        timeout = st.settings.gateway_embed_timeout
        with pooling_span(api, model, inputs, **attributes) as done:
            try:
                replies = await asyncio.gather(*(st.client.call(model, part, reply, timeout)
                                                 for part in batches))
            except BaseException:
                st.quota.release(ticket)
                raise
            tokens = sum(r.prompt_tokens for r in replies)
            done(tokens)
        st.quota.record(ticket, Usage(prompt_tokens=tokens, completion_tokens=0))
        return list(replies)


@routes.post("/v1/score")
@routes.post("/score")
async def score(request: web.Request) -> web.Response:
    """vLLM's score API: a cross-encoder's score of each (text_1, text_2) pair (score.py)."""
    body = parse_body(await read_body(request), ScoreBody)
    replies = await _score_pairs(request, body, "score", "text_2")
    return web.json_response(score_response(body, replies).body())


@routes.post("/v1/rerank")
@routes.post("/rerank")
@routes.post("/v2/rerank")
async def rerank(request: web.Request) -> web.Response:
    """Jina's and Cohere's rerank API as vLLM serves it: the documents, best first."""
    body = parse_body(await read_body(request), RerankBody)
    replies = await _score_pairs(request, body, "rerank", "documents")
    return web.json_response(rerank_response(body, replies).body())
