"""The OpenAPI 3 document served at /openapi.json: every route, request bodies from the pydantic
models the gateway validates with, the OpenAI routes' answers from the models it answers with
(openai/objects.py; a streamed answer's events too), and OpenAI's error shape for failures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from shoal.services.gateway.anthropic.objects import (
    AnthropicError, Message, MessageStreamEvent, MessageTokensCount
)
from shoal.services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from shoal.services.gateway.openai.lora_routes import LoadLoRABody, UnloadLoRABody
from shoal.services.gateway.openai.embeddings import EmbeddingBody, EmbeddingList
from shoal.services.gateway.openai.score import (
    RerankBody, RerankResponse, ScoreBody, ScoreResponse
)
from shoal.services.gateway.responses_api.objects import (
    ResponseDeleted, ResponseObject, ResponseStreamEvent
)
from shoal.services.gateway.responses_api.protocol import ResponsesRequest
from shoal.services.gateway.openai.objects import (
    ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk, DetokenizeResponse,
    ErrorResponse, ModelCard, ModelList, TokenizeResponse
)
from shoal.services.gateway.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody
)
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyCreated, ApiKeyPublic, ApiKeyUpdate, Deleted, InstancePublic, ModelCreate,
    ModelPublic, ModelUpdate, WorkerPublic
)
from shoal.shared.schemas.scheduler import PlacementPlan

_OPS: list[tuple[str, str, str, type[BaseModel] | None, str]] = [
    ("get", "/v1/models", "List models", None, "openai"),
    ("get", "/v1/models/{name}", "Get a model", None, "openai"),
    ("post", "/v1/completions", "Create a completion (stream: SSE)", CompletionRequest, "openai"),
    ("post", "/v1/chat/completions", "Create a chat completion (stream: SSE)",
     ChatCompletionRequest, "openai"),
    ("post", "/v1/embeddings", "Create embeddings (an embedding model's instances)",
     EmbeddingBody, "openai"),
    ("post", "/v1/score", "Score text pairs with a cross-encoder (vLLM's score API; also "
     "/score)", ScoreBody, "openai"),
    ("post", "/v1/rerank", "Rerank documents against a query with a cross-encoder (Jina's and "
     "Cohere's shape, as vLLM serves it; also /rerank, /v2/rerank)", RerankBody, "openai"),
    ("post", "/v1/messages", "Create a message, Anthropic's Messages API (stream: SSE; "
     "auth: x-api-key or Bearer)", MessagesRequest, "anthropic"),
    ("post", "/v1/messages/count_tokens", "Count a message's input tokens (Anthropic's API)",
     CountTokensRequest, "anthropic"),
    ("post", "/v1/responses", "Create a response, OpenAI's Responses API (stream: SSE; "
     "previous_response_id continues a stored one)", ResponsesRequest, "openai"),
    ("get", "/v1/responses/{id}", "Get a stored response (the key that created it)", None,
     "openai"),
    ("delete", "/v1/responses/{id}", "Delete a stored response", None, "openai"),
    ("post", "/tokenize", "Tokenize a prompt or messages", TokenizeBody, "openai"),
    ("post", "/v1/load_lora_adapter", "Load a LoRA adapter onto a model (vLLM's; admin key)",
     LoadLoRABody, "openai"),
    ("post", "/v1/unload_lora_adapter", "Unload a LoRA adapter (vLLM's; admin key)",
     UnloadLoRABody, "openai"),
    ("post", "/detokenize", "Detokenize token ids", DetokenizeBody, "openai"),
    ("get", "/health", "Liveness: 200 while the gateway runs", None, "ops"),
    ("get", "/version", "Version", None, "ops"),
    ("get", "/metrics", "Prometheus metrics: what clients see, under vLLM's names", None, "ops"),
    ("get", "/metrics/targets", "Every process's /metrics, for Prometheus http_sd_configs", None,
     "ops"),
    ("get", "/openapi.json", "This document", None, "ops"),
    ("get", "/api/v1/models", "List models", None, "management"),
    ("post", "/api/v1/models", "Deploy a model (?dry_run=true: where it would go, nothing "
     "written); what can never run is a 400 naming the field", ModelCreate, "management"),
    ("get", "/api/v1/models/{id}", "Get a model by id or name", None, "management"),
    ("patch", "/api/v1/models/{id}", "Update a model (send the version you read; stale: 409)",
     ModelUpdate, "management"),
    ("delete", "/api/v1/models/{id}", "Delete a model (?version=N: refused when stale)", None,
     "management"),
    ("get", "/api/v1/instances", "List instances (?model, ?model_id, ?worker_id, ?state)", None,
     "management"),
    ("get", "/api/v1/instances/{id}", "Get an instance", None, "management"),
    ("delete", "/api/v1/instances/{id}", "Delete an instance", None, "management"),
    ("get", "/api/v1/loads", "Live engine loads as this gateway sees them (running, waiting, "
     "KV-cache use, token counters)", None, "management"),
    ("get", "/api/v1/workers", "List workers", None, "management"),
    ("get", "/api/v1/workers/{id}", "Get a worker", None, "management"),
    ("delete", "/api/v1/workers/{id}", "Delete a worker", None, "management"),
    ("get", "/api/v1/auth", "Whether keys are required here, and the key presented", None,
     "management"),
    ("get", "/api/v1/keys", "List API keys", None, "management"),
    ("post", "/api/v1/keys", "Create an API key (the secret is shown once)", ApiKeyCreate,
     "management"),
    ("get", "/api/v1/keys/{id}", "Get an API key by id or name", None, "management"),
    ("delete", "/api/v1/keys/{id}", "Revoke an API key (by id or name)", None, "management"),
    ("patch", "/api/v1/keys/{id}", "Change a key's scope or limits", ApiKeyUpdate, "management"),
    ("get", "/api/v1/usage", "Usage per key, model and day (?key_id, ?model, ?since, ?until)",
     None, "management"),
]


@dataclass(frozen=True)
class Answer:
    """A route's 200: its JSON object, and for `stream: true` the object of each SSE event."""

    model: type[BaseModel]
    event: type[BaseModel] | None = None
    many: bool = False
    """A JSON array of `model` (the management API's lists)."""
    ending: str = "then `data: [DONE]`"
    """What a stream ends with."""


_ANSWERS: dict[tuple[str, str], Answer] = {
    ("get", "/v1/models"): Answer(ModelList),
    ("get", "/v1/models/{name}"): Answer(ModelCard),
    ("post", "/v1/completions"): Answer(Completion, CompletionChunk),
    ("post", "/v1/chat/completions"): Answer(ChatCompletion, ChatCompletionChunk),
    ("post", "/v1/embeddings"): Answer(EmbeddingList),
    ("post", "/v1/score"): Answer(ScoreResponse),
    ("post", "/v1/rerank"): Answer(RerankResponse),
    ("post", "/v1/messages"): Answer(
        Message, MessageStreamEvent, ending="each named by its `event:` line, in Anthropic's "
        "order, ending with message_stop"),
    ("post", "/v1/messages/count_tokens"): Answer(MessageTokensCount),
    ("post", "/v1/responses"): Answer(ResponseObject, ResponseStreamEvent, ending="each "
                                      "named by its `event:` line, ending with "
                                      "response.completed (or response.incomplete)"),
    ("get", "/v1/responses/{id}"): Answer(ResponseObject),
    ("delete", "/v1/responses/{id}"): Answer(ResponseDeleted),
    ("post", "/tokenize"): Answer(TokenizeResponse),
    ("post", "/detokenize"): Answer(DetokenizeResponse),
    ("get", "/api/v1/models"): Answer(ModelPublic, many=True),
    ("post", "/api/v1/models"): Answer(PlacementPlan),  # ?dry_run=true; a deploy is a 201
    ("get", "/api/v1/models/{id}"): Answer(ModelPublic),
    ("patch", "/api/v1/models/{id}"): Answer(ModelPublic),
    ("delete", "/api/v1/models/{id}"): Answer(Deleted),
    ("get", "/api/v1/instances"): Answer(InstancePublic, many=True),
    ("get", "/api/v1/instances/{id}"): Answer(InstancePublic),
    ("delete", "/api/v1/instances/{id}"): Answer(Deleted),
    ("get", "/api/v1/loads"): Answer(EngineLoad, many=True),
    ("get", "/api/v1/workers"): Answer(WorkerPublic, many=True),
    ("get", "/api/v1/workers/{id}"): Answer(WorkerPublic),
    ("delete", "/api/v1/workers/{id}"): Answer(Deleted),
    ("get", "/api/v1/keys"): Answer(ApiKeyPublic, many=True),
    ("get", "/api/v1/keys/{id}"): Answer(ApiKeyPublic),
    ("delete", "/api/v1/keys/{id}"): Answer(ApiKeyPublic),
    ("patch", "/api/v1/keys/{id}"): Answer(ApiKeyPublic),
}
_CREATED: dict[tuple[str, str], Answer] = {
    ("post", "/api/v1/models"): Answer(ModelPublic),
    ("post", "/api/v1/keys"): Answer(ApiKeyCreated),
}
"""Routes whose success is a 201 with the object made."""
_ERRORS = {"400": "Bad input", "401": "Missing or invalid API key",
           "404": "Unknown model or resource",
           "409": "Stale version", "429": "Too many requests in flight",
           "503": "No instance can serve now"}


def _ref(model: type[BaseModel], schemas: dict[str, Any]) -> dict[str, str]:
    """Put `model`'s schema (and those it uses) into `schemas`; a reference to it."""
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    found = {**schema.pop("$defs", {}), model.__name__: schema}
    for name, one in found.items():  # two different models of one name: a wrong document
        assert schemas.setdefault(name, one) == one, f"two schemas named {name}"
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _ok(answer: Answer | None, schemas: dict[str, Any]) -> dict[str, Any]:
    if answer is None:
        return {"description": "OK"}
    schema = _ref(answer.model, schemas)
    if answer.many:
        schema = {"type": "array", "items": schema}
    content: dict[str, Any] = {"application/json": {"schema": schema}}
    if answer.event is None:
        name = answer.model.__name__
        return {"description": f"a list of {name}" if answer.many else name, "content": content}
    content["text/event-stream"] = {"schema": {
        **_ref(answer.event, schemas), "description": f"with stream: true, server-sent events: "
        f"one `data: <{answer.event.__name__}>` per chunk, {answer.ending}"}}
    return {"description": f"{answer.model.__name__}, or {answer.event.__name__} events when "
            "streamed", "content": content}


def openapi_document(version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {}
    errors = {"openai": _ref(ErrorResponse, schemas),
              "anthropic": _ref(AnthropicError, schemas)}
    for method, path, summary, body, tag in _OPS:
        op: dict[str, Any] = {
            "summary": summary, "tags": [tag],
            "responses": {**({"201": _ok(_CREATED[method, path], schemas)}
                             if (method, path) in _CREATED else {}),
                          **({"200": _ok(_ANSWERS.get((method, path)), schemas)}
                             if (method, path) in _ANSWERS or (method, path) not in _CREATED
                             else {}),
                          **{code: {"description": text, "content": {"application/json": {
                              "schema": errors.get(tag, errors["openai"])}}}
                             for code, text in _ERRORS.items()}},
        }
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string"}}
                                for p in params]
        if body is not None:
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": _ref(body, schemas)}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Shoal gateway", "version": version,
                 "description": "OpenAI-compatible serving API and Shoal's management API."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {
                           "bearer": {"type": "http", "scheme": "bearer"},
                           "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}},
        "security": [{"bearer": []}, {"x-api-key": []}],
    }
