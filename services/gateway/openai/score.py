"""/v1/score and /v1/rerank (vLLM's shapes; rerank is Jina's and Cohere's): the bodies, their
split into bus-sized batches of text pairs, and the answers built from a cross-encoder's scores.

Score pairs `text_1` with `text_2` as vLLM does: one text against each of a list, or two lists
of one length pairwise. Rerank scores the query against each document and answers them best
first, `top_n` of them (0 or unset: all). A long list goes as several ScoreRequests (at most
`BATCH_INPUTS` pairs, about `BATCH_TEXT_BYTES` of text each) to the model's instances at once.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from shoal.services.gateway.openai.body import Body
from shoal.services.gateway.openai.embeddings import BATCH_INPUTS, BATCH_TEXT_BYTES, MAX_INPUTS
from shoal.services.gateway.openai.objects import OpenAIObject
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import ScoreReply, ScoreRequest


class ScoreUsage(OpenAIObject):
    prompt_tokens: int
    total_tokens: int


class ScoreData(OpenAIObject):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(OpenAIObject):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankDocument(OpenAIObject):
    text: str


class RerankResult(OpenAIObject):
    index: int
    document: RerankDocument | None = None
    """The document's text, unless the request said `return_documents: false`."""
    relevance_score: float


class RerankResponse(OpenAIObject):
    id: str
    model: str
    usage: ScoreUsage
    results: list[RerankResult]


def _check_texts(texts: Sequence[str], param: str) -> None:
    if not texts:
        raise InvalidRequest(f"{param} must not be empty", param=param)
    if len(texts) > MAX_INPUTS:
        raise InvalidRequest(f"at most {MAX_INPUTS} texts per request, got {len(texts)}",
                             param=param)
    for i, text in enumerate(texts):
        if not text:
            raise InvalidRequest(f"{param}[{i}] is empty", param=param)


class PairBody(Body):
    model: str = Field(min_length=1)
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    """vLLM's: keep at most this many tokens of each pair (-1: the model's limit)."""
    user: str | None = None

    def pairs(self) -> tuple[list[str], list[str]]:
        raise NotImplementedError

    def batches(self) -> list[ScoreRequest]:
        """Bus requests of at most BATCH_INPUTS pairs / ~BATCH_TEXT_BYTES of text each."""
        left, right = self.pairs()
        out: list[ScoreRequest] = []
        start = 0
        while start < len(left):
            end, size = start, 0
            while end < len(left) and end - start < BATCH_INPUTS:
                size += len(left[end].encode()) + len(right[end].encode())
                if end > start and size > BATCH_TEXT_BYTES:
                    break
                end += 1
            out.append(ScoreRequest(model=self.model, text_1=left[start:end],
                                    text_2=right[start:end],
                                    truncate_prompt_tokens=self.truncate_prompt_tokens))
            start = end
        return out


class ScoreBody(PairBody):
    """POST /v1/score (vLLM's): text_1 against text_2."""

    text_1: str | list[str]
    text_2: str | list[str]

    def check(self) -> None:
        left, right = self._lists()
        _check_texts(left, "text_1")
        _check_texts(right, "text_2")
        if len(left) > 1 and len(left) != len(right):
            raise InvalidRequest(f"text_1 has {len(left)} texts and text_2 {len(right)}: give "
                                 "one text_1, or as many as text_2", param="text_2")

    def _lists(self) -> tuple[list[str], list[str]]:
        return ([self.text_1] if isinstance(self.text_1, str) else list(self.text_1),
                [self.text_2] if isinstance(self.text_2, str) else list(self.text_2))

    def pairs(self) -> tuple[list[str], list[str]]:
        left, right = self._lists()
        return (left * len(right) if len(left) == 1 else left), right


class RerankBody(PairBody):
    """POST /v1/rerank (also /rerank, /v2/rerank): the query against each document."""

    query: str = Field(min_length=1)
    documents: list[str]
    top_n: int | None = Field(default=None, ge=0)
    """How many results, best first (0 or unset: all)."""
    return_documents: bool = True

    def check(self) -> None:
        _check_texts(self.documents, "documents")

    def pairs(self) -> tuple[list[str], list[str]]:
        return [self.query] * len(self.documents), list(self.documents)


def _scores(replies: Sequence[ScoreReply], expected: int) -> tuple[list[float], ScoreUsage]:
    scores = [s for r in replies for s in r.scores]
    if len(scores) != expected:
        raise InvalidRequest("malformed score reply from the engine")
    tokens = sum(r.prompt_tokens for r in replies)
    return scores, ScoreUsage(prompt_tokens=tokens, total_tokens=tokens)


def score_response(body: ScoreBody, replies: Sequence[ScoreReply]) -> ScoreResponse:
    scores, usage = _scores(replies, len(body.pairs()[0]))
    return ScoreResponse(id=f"score-{uuid.uuid4().hex}", created=int(time.time()),
                         model=body.model, usage=usage,
                         data=[ScoreData(index=i, score=s) for i, s in enumerate(scores)])


def rerank_response(body: RerankBody, replies: Sequence[ScoreReply]) -> RerankResponse:
    scores, usage = _scores(replies, len(body.documents))
    order = sorted(range(len(scores)), key=lambda i: -scores[i])  # stable: ties keep order
    if body.top_n:
        order = order[:body.top_n]
    results = [RerankResult(index=i, relevance_score=scores[i],
                            document=RerankDocument(text=body.documents[i])
                            if body.return_documents else None) for i in order]
    return RerankResponse(id=f"rerank-{uuid.uuid4().hex}", model=body.model, usage=usage,
                          results=results)
