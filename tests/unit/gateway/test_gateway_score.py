"""/v1/score's and /v1/rerank's pure part: vLLM's pairing of text_1 with text_2, refusals naming
the field, the split into bus-sized batches, and the answers (rerank best first, top_n,
return_documents)."""

from __future__ import annotations

import json

import pytest

from shoal.services.gateway.openai.embeddings import BATCH_INPUTS
from shoal.services.gateway.openai.protocol import parse_body
from shoal.services.gateway.openai.score import (
    RerankBody, ScoreBody, rerank_response, score_response
)
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import ScoreReply


def score_body(**fields: object) -> ScoreBody:
    return parse_body(json.dumps({"model": "m", **fields}).encode(), ScoreBody)


def rerank_body(**fields: object) -> RerankBody:
    return parse_body(json.dumps({"model": "m", "query": "q", **fields}).encode(), RerankBody)


def test_score_pairs_one_against_many_or_pairwise() -> None:
    assert score_body(text_1="a", text_2="b").pairs() == (["a"], ["b"])
    assert score_body(text_1="a", text_2=["b", "c"]).pairs() == (["a", "a"], ["b", "c"])
    assert score_body(text_1=["a", "b"], text_2=["c", "d"]).pairs() == (["a", "b"], ["c", "d"])
    assert rerank_body(documents=["x", "y"]).pairs() == (["q", "q"], ["x", "y"])


@pytest.mark.parametrize("make, fields, param", [
    (score_body, {"text_1": "a", "text_2": []}, "text_2"),
    (score_body, {"text_1": [], "text_2": "b"}, "text_1"),
    (score_body, {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
    (score_body, {"text_1": "a", "text_2": ["b", ""]}, "text_2"),
    (score_body, {"text_2": "b"}, "text_1"),
    (rerank_body, {"documents": []}, "documents"),
    (rerank_body, {"documents": ["a", ""]}, "documents"),
    (rerank_body, {"documents": ["a"] * 2049}, "documents"),
    (rerank_body, {"documents": ["a"], "top_n": -1}, "top_n"),
    (rerank_body, {"documents": ["a"], "query": ""}, "query"),
    (rerank_body, {}, "documents"),
])
def test_bad_input_is_a_400_naming_the_field(make, fields: dict[str, object],
                                             param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        make(**fields)
    assert err.value.param == param


def test_long_lists_split_into_bus_sized_batches() -> None:
    docs = [f"doc {i}" for i in range(BATCH_INPUTS * 2 + 3)]
    batches = rerank_body(documents=docs, truncate_prompt_tokens=-1).batches()
    assert [len(b.text_2) for b in batches] == [BATCH_INPUTS, BATCH_INPUTS, 3]
    assert [t for b in batches for t in b.text_2] == docs
    assert all(b.text_1 == ["q"] * len(b.text_2) and b.truncate_prompt_tokens == -1
               for b in batches)


def test_rerank_answers_best_first() -> None:
    body = rerank_body(documents=["a", "b", "c", "d"], top_n=3)
    replies = [ScoreReply(scores=[0.1, 0.9], prompt_tokens=7),
               ScoreReply(scores=[0.5, 0.9], prompt_tokens=5)]
    out = rerank_response(body, replies).body()
    assert [r["index"] for r in out["results"]] == [1, 3, 2]  # ties keep the documents' order
    assert out["results"][0] == {"index": 1, "document": {"text": "b"}, "relevance_score": 0.9}
    assert out["usage"] == {"prompt_tokens": 12, "total_tokens": 12}
    assert out["model"] == "m" and out["id"].startswith("rerank-")
    bare = rerank_response(rerank_body(documents=["a", "b"], return_documents=False),
                           replies[:1]).body()
    assert [r["document"] for r in bare["results"]] == [None, None]
    assert [r["index"] for r in bare["results"]] == [1, 0]


def test_score_answer_in_input_order() -> None:
    out = score_response(score_body(text_1="q", text_2=["a", "b"]),
                         [ScoreReply(scores=[0.25, 0.75], prompt_tokens=9)]).body()
    assert out["data"] == [{"index": 0, "object": "score", "score": 0.25},
                           {"index": 1, "object": "score", "score": 0.75}]
    assert out["object"] == "list" and out["usage"]["prompt_tokens"] == 9
    with pytest.raises(InvalidRequest):  # an engine that answered fewer scores than pairs
        score_response(score_body(text_1="q", text_2=["a", "b"]),
                       [ScoreReply(scores=[0.5], prompt_tokens=1)])
