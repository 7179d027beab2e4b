"""The pooling routes (vLLM's name for models that answer with vectors or scores, not text):
/v1/embeddings, and vLLM's /v1/score and /v1/rerank for cross-encoders. Each splits its input
into batches sent to the model's instances in parallel, under the key's limits, and counts the
prompt tokens as usage.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from shoal.services.gateway.auth.reservation import prompt_tokens
from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.embeddings import EmbeddingBody, embedding_response
from shoal.services.gateway.openai.score import (
    PairBody, RerankBody, ScoreBody, rerank_response, score_response
)
from shoal.services.gateway.state import STATE
from shoal.shared.logging import log_context
from shoal.shared.schemas.infer import EmbedReply, ScoreReply, Usage

routes = web.RouteTableDef()


@routes.post("/v1/embeddings")
async def embeddings(request: web.Request) -> web.Response:
    """Batches of the input go to the model's instances in parallel (embeddings.py)."""
    st = request.app[STATE]
    body = parse_body(await read_body(request), EmbeddingBody)
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    batches = body.batches()  # each is one engine request in flight: what admission counts
    with st.admission.slot(len(batches), param="input"), log_context(model=body.model):
        ticket = await st.quota.admit(request, body.model,
                                      lambda: sum(prompt_tokens(x) for x in body.inputs()))
        timeout = st.settings.gateway_embed_timeout
        try:
            replies = await asyncio.gather(*(st.client.call(body.model, part, EmbedReply,
                                                            timeout) for part in batches))
        except BaseException:
            st.quota.release(ticket)
            raise
        st.quota.record(ticket, Usage(prompt_tokens=sum(r.prompt_tokens for r in replies),
                                      completion_tokens=0))
        return web.json_response(
            embedding_response(body.model, replies, body.encoding_format).body())


async def _score_pairs(request: web.Request, body: PairBody, api: str, param: str
                       ) -> list[ScoreReply]:
    """A score or rerank body's pairs, in batches to the model's instances in parallel, under
    the key's limits; the prompt tokens counted as usage."""
    st = request.app[STATE]
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    batches = body.batches()
    with st.admission.slot(len(batches), param=param), log_context(model=body.model):
        left, right = body.pairs()
        ticket = await st.quota.admit(request, body.model, lambda: sum(
            prompt_tokens(a) + prompt_tokens(b) for a, b in zip(left, right)))
        timeout = st.settings.gateway_embed_timeout
        try:
            replies = await asyncio.gather(*(st.client.call(body.model, part, ScoreReply,
                                                            timeout) for part in batches))
        except BaseException:
            st.quota.release(ticket)
            raise
        st.quota.record(ticket, Usage(prompt_tokens=sum(r.prompt_tokens for r in replies),
                                      completion_tokens=0))
        st.metrics.api_requests.labels(api, body.model).inc()
        return replies


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
