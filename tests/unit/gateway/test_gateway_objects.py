"""The typed OpenAI answers (openai/objects.py): every body the gateway builds validates against
the openai SDK's own pydantic types (not only its lenient parse), and /openapi.json names the
schema of each OpenAI route's 200 answer (and of its streamed events)."""

from __future__ import annotations

import base64
import json
import struct
from typing import Any

import pytest
from openai.types import Completion as SdkCompletion
from openai.types import CreateEmbeddingResponse
from openai.types import Model as SdkModel
from openai.types.chat import ChatCompletion as SdkChatCompletion
from openai.types.chat import ChatCompletionChunk as SdkChatCompletionChunk
from openai.types.shared import ErrorObject

from shoal.services.gateway.errors import error_body
from shoal.services.gateway.management.openapi import openapi_document
from shoal.services.gateway.openai.builders import ChatResponseBuilder, CompletionResponseBuilder
from shoal.services.gateway.openai.embeddings import embedding_response
from shoal.services.gateway.openai.objects import (
    ErrorResponse, ModelCard, ModelList, TokenizeResponse
)
from shoal.services.gateway.openai.streaming import parse_sse, sse_event
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import ChoiceDelta, EmbedReply, TokenLogprobWire, TopLogprob, Usage

USAGE = Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=4)


def lp(token: str, value: float) -> TokenLogprobWire:
    return TokenLogprobWire(token_id=1, token=token, logprob=value,
                            top=[TopLogprob(token_id=1, token=token, logprob=value)])


def delta(text: str, finish: str | None = None, logprobs: bool = True) -> ChoiceDelta:
    return ChoiceDelta(index=0, text=text, token_ids=[1], finish_reason=finish,
                       logprobs=[lp(text, -0.5)] if logprobs else None)


def wire(obj: Any) -> dict[str, Any]:
    """The JSON a client receives, as an SSE event carries it (the same bytes as json bodies)."""
    (event,) = parse_sse(sse_event(obj))
    return json.loads(event)


def test_chat_answers_validate_against_the_sdk() -> None:
    b = ChatResponseBuilder("m", want_logprobs=True)
    chunks = [b.chunk([b.with_role(b.apply(delta("Hi"), 0))]),
              b.chunk([b.with_role(b.apply(delta(" there", "stop"), 0))], USAGE, True)]
    b.usage = USAGE
    chunks.append(b.chunk([], b.usage, with_usage=True))  # the closing usage chunk
    for chunk in chunks:
        parsed = SdkChatCompletionChunk.model_validate(wire(chunk))
        assert parsed.object == "chat.completion.chunk" and parsed.id == b.id
    first = SdkChatCompletionChunk.model_validate(wire(chunks[0]))
    assert first.choices[0].delta.role == "assistant" and first.choices[0].delta.content == "Hi"
    assert first.choices[0].logprobs.content[0].bytes == list(b"Hi")
    final = SdkChatCompletion.model_validate(wire(b.final()))
    assert final.choices[0].message.content == "Hi there"
    assert final.choices[0].finish_reason == "stop"
    assert final.usage.prompt_tokens_details.cached_tokens == 4
    assert [t.token for t in final.choices[0].logprobs.content] == ["Hi", " there"]


def test_chat_tool_calls_validate_against_the_sdk() -> None:
    b = ChatResponseBuilder("m", tool_mode=ToolMode("named", "get_weather"))
    streamed = [b.chunk([b.with_role(b.apply(delta('{"city": ', logprobs=False), 0))]),
                b.chunk([b.apply(delta('"Oslo"}', "stop", logprobs=False), 0)])]
    parsed = [SdkChatCompletionChunk.model_validate(wire(c)) for c in streamed]
    call = parsed[0].choices[0].delta.tool_calls[0]
    assert call.function.name == "get_weather" and call.id and call.type == "function"
    assert parsed[1].choices[0].delta.tool_calls[0].function.name is None
    assert parsed[1].choices[0].finish_reason == "tool_calls"
    final = SdkChatCompletion.model_validate(wire(b.final()))
    (tool_call,) = final.choices[0].message.tool_calls
    assert json.loads(tool_call.function.arguments) == {"city": "Oslo"}
    assert final.choices[0].message.content is None


def test_completion_answers_validate_against_the_sdk() -> None:
    b = CompletionResponseBuilder("m", want_logprobs=True)
    streamed = [b.chunk([b.echo(0, "Say:")]), b.chunk([b.apply(delta("a"), 0)]),
                b.chunk([b.apply(delta("b", "length"), 0)], USAGE, True)]
    # the SDK streams completions as Completion objects, whose type wants a finish_reason: the
    # chunks before the last have none (null, as OpenAI and vLLM send them; the SDK's stream
    # parse does not validate), so those are checked with the last one's reason in their place
    last = SdkCompletion.model_validate(wire(streamed[-1]))
    assert last.choices[0].finish_reason == "length" and last.usage.total_tokens == 10
    for chunk in streamed[:-1]:
        body = wire(chunk)
        assert body["choices"][0].pop("finish_reason") is None
        body["choices"][0]["finish_reason"] = "length"
        assert SdkCompletion.model_validate(body).object == "text_completion"
    b.usage = USAGE
    final = SdkCompletion.model_validate(wire(b.final({0: "Say:"})))
    assert final.choices[0].text == "Say:ab" and final.choices[0].finish_reason == "length"
    assert final.choices[0].logprobs.text_offset == [0, 1]
    assert final.usage.total_tokens == 10


def test_embeddings_models_errors_validate_against_the_sdk() -> None:
    vectors = [[0.5, -1.0], [2.0, 3.0]]
    raw = b"".join(struct.pack("<2f", *v) for v in vectors)
    reply = EmbedReply(data=base64.b64encode(raw).decode(), num_inputs=2, dimensions=2,
                       prompt_tokens=5)
    out = CreateEmbeddingResponse.model_validate(wire(embedding_response("m", [reply], "float")))
    assert [d.embedding for d in out.data] == vectors and out.usage.total_tokens == 5
    b64 = wire(embedding_response("m", [reply], "base64"))  # the SDK decodes this itself
    assert isinstance(b64["data"][0]["embedding"], str)
    card = ModelCard(id="alias", created=1, root="m", max_model_len=2048,
                     has_running_instance=True)
    listed = wire(ModelList(data=[card]))
    assert SdkModel.model_validate(listed["data"][0]).id == "alias"
    assert listed["data"][0] == wire(card) and listed["data"][0]["parent"] is None
    _, body = error_body(InvalidRequest("bad n", param="n"))
    assert ErrorObject.model_validate(ErrorResponse.model_validate(body).error.body()).param == "n"
    assert wire(TokenizeResponse(count=2, max_model_len=8, tokens=[1, 2])) == {
        "count": 2, "max_model_len": 8, "tokens": [1, 2]}


OPENAI_ROUTES = [("get", "/v1/models", "ModelList"), ("get", "/v1/models/{name}", "ModelCard"),
                 ("post", "/v1/completions", "Completion"),
                 ("post", "/v1/chat/completions", "ChatCompletion"),
                 ("post", "/v1/embeddings", "EmbeddingList"),
                 ("post", "/v1/score", "ScoreResponse"), ("post", "/v1/rerank", "RerankResponse"),
                 ("post", "/tokenize", "TokenizeResponse"),
                 ("post", "/detokenize", "DetokenizeResponse")]


@pytest.mark.parametrize("method, path, name", OPENAI_ROUTES)
def test_openapi_names_each_openai_answer(method: str, path: str, name: str) -> None:
    doc = openapi_document("test")
    schemas = doc["components"]["schemas"]
    ok = doc["paths"][path][method]["responses"]["200"]
    assert ok["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{name}"}
    assert schemas[name]["type"] == "object" and schemas[name]["properties"]
    error = doc["paths"][path][method]["responses"]["400"]["content"]["application/json"]
    assert error["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    if path.endswith("completions"):  # stream: true answers SSE events of the chunk type
        event = ok["content"]["text/event-stream"]["schema"]
        assert event["$ref"] == f"#/components/schemas/{name}Chunk"


def test_openapi_references_all_resolve() -> None:
    doc = openapi_document("test")
    text = json.dumps(doc)
    refs = {part.split('"')[0] for part in text.split('"$ref": "#/components/schemas/')[1:]}
    assert refs and refs <= set(doc["components"]["schemas"]), refs - set(
        doc["components"]["schemas"])
    assert {"ChatCompletionChunk", "CompletionChunk", "DeltaMessage", "UsageInfo"} <= refs


@pytest.mark.parametrize("method, path, status, name, many", [
    ("get", "/api/v1/models", "200", "ModelPublic", True),
    ("post", "/api/v1/models", "201", "ModelPublic", False),
    ("post", "/api/v1/models", "200", "PlacementPlan", False),  # ?dry_run=true
    ("get", "/api/v1/instances/{id}", "200", "InstancePublic", False),
    ("get", "/api/v1/loads", "200", "EngineLoad", True),
    ("get", "/api/v1/workers", "200", "WorkerPublic", True),
    ("post", "/api/v1/keys", "201", "ApiKeyCreated", False),
    ("delete", "/api/v1/models/{id}", "200", "Deleted", False),
])
def test_openapi_names_the_management_answers(method: str, path: str, status: str, name: str,
                                              many: bool) -> None:
    """/docs said only "200 OK" for the management API; each answer is the registry's model."""
    doc = openapi_document("test")
    schema = doc["paths"][path][method]["responses"][status]["content"]["application/json"][
        "schema"]
    ref = {"$ref": f"#/components/schemas/{name}"}
    assert schema == ({"type": "array", "items": ref} if many else ref)
    assert doc["components"]["schemas"][name]["properties"]
