"""/v1/embeddings' pure part: OpenAI's four input forms, refusals naming `input`, the split into
bus-sized batches, and the answer in float and base64."""

from __future__ import annotations

import base64
import json
import struct

import pytest

from shoal.services.gateway.openai.embeddings import (
    BATCH_INPUTS, EmbeddingBody, embedding_response
)
from shoal.services.gateway.openai.protocol import parse_body
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import EmbedReply


def body(**fields: object) -> EmbeddingBody:
    return parse_body(json.dumps({"model": "m", **fields}).encode(), EmbeddingBody)


def test_input_forms() -> None:
    assert body(input="hi").inputs() == ["hi"]
    assert body(input=["a", "b"]).inputs() == ["a", "b"]
    assert body(input=[1, 2, 3]).inputs() == [[1, 2, 3]]
    assert body(input=[[1, 2], [3]]).inputs() == [[1, 2], [3]]
    assert body(input="x").encoding_format == "float"


@pytest.mark.parametrize("fields, param", [
    ({"input": ""}, "input"), ({"input": []}, "input"), ({"input": ["a", ""]}, "input"),
    ({"input": [[1], []]}, "input"), ({"input": [-1]}, "input"), ({"input": 3}, "input"),
    ({"input": ["a"] * 2049}, "input"), ({"input": "a", "encoding_format": "hex"},
                                         "encoding_format"),
    ({"input": "a", "dimensions": 0}, "dimensions"), ({}, "input"),
])
def test_bad_input_is_a_400_naming_the_field(fields: dict[str, object], param: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        body(**fields)
    assert err.value.param == param


def test_long_inputs_split_into_bus_sized_batches() -> None:
    parts = body(input=[f"text {i}" for i in range(150)], dimensions=8).batches()
    assert [len(p.texts or []) for p in parts] == [BATCH_INPUTS, BATCH_INPUTS,
                                                   150 - 2 * BATCH_INPUTS]
    assert all(p.dimensions == 8 and p.token_ids is None for p in parts)
    big = body(input=["x" * 100_000] * 5).batches()  # ~256 KB of text per message at most
    assert [len(p.texts or []) for p in big] == [2, 2, 1]
    ids = body(input=[[1, 2]] * 3).batches()
    assert len(ids) == 1 and ids[0].token_ids == [[1, 2]] * 3 and ids[0].texts is None


def test_response_in_float_and_base64() -> None:
    vectors = [[0.5, -1.0, 0.25], [1.0, 2.0, 3.0]]
    raw = b"".join(struct.pack("<3f", *v) for v in vectors)
    reply = EmbedReply(data=base64.b64encode(raw).decode(), num_inputs=2, dimensions=3,
                       prompt_tokens=7)
    out = embedding_response("m", [reply, reply], "float").body()
    assert [d["embedding"] for d in out["data"]] == vectors * 2
    assert [d["index"] for d in out["data"]] == [0, 1, 2, 3]
    assert out["usage"] == {"prompt_tokens": 14, "total_tokens": 14}
    b64 = embedding_response("m", [reply], "base64").body()["data"]
    assert [list(struct.unpack("<3f", base64.b64decode(d["embedding"]))) for d in b64] == vectors
