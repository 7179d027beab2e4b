"""The OpenAPI 3 document served at /openapi.json: every route, request bodies from the pydantic
models the gateway validates with, and OpenAI's error shape for failures.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from shoal.services.gateway.openai.embeddings import EmbeddingBody
from shoal.services.gateway.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody
)
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyUpdate, ModelCreate, ModelUpdate

_ERROR = {"type": "object", "properties": {"error": {"type": "object", "properties": {
    "message": {"type": "string"}, "type": {"type": "string"},
    "param": {"type": ["string", "null"]},
    "code": {"type": ["string", "null"]}}}}}
_OPS: list[tuple[str, str, str, type[BaseModel] | None, str]] = [
    ("get", "/v1/models", "List models", None, "openai"),
    ("get", "/v1/models/{name}", "Get a model", None, "openai"),
    ("post", "/v1/completions", "Create a completion (stream: SSE)", CompletionRequest, "openai"),
    ("post", "/v1/chat/completions", "Create a chat completion (stream: SSE)",
     ChatCompletionRequest, "openai"),
    ("post", "/v1/embeddings", "Create embeddings (an embedding model's instances)",
     EmbeddingBody, "openai"),
    ("post", "/tokenize", "Tokenize a prompt or messages", TokenizeBody, "openai"),
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
_ERRORS = {"400": "Bad input", "401": "Missing or invalid API key",
           "404": "Unknown model or resource",
           "409": "Stale version", "429": "Too many requests in flight",
           "503": "No instance can serve now"}


def openapi_document(version: str) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    schemas: dict[str, Any] = {"Error": _ERROR}
    for method, path, summary, body, tag in _OPS:
        op: dict[str, Any] = {
            "summary": summary, "tags": [tag],
            "responses": {"200": {"description": "OK"},
                          **{code: {"description": text, "content": {"application/json": {
                              "schema": {"$ref": "#/components/schemas/Error"}}}}
                             for code, text in _ERRORS.items()}},
        }
        params = [p.strip("{}") for p in path.split("/") if p.startswith("{")]
        if params:
            op["parameters"] = [{"name": p, "in": "path", "required": True,
                                 "schema": {"type": "string"}}
                                for p in params]
        if body is not None:
            schema = body.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(schema.pop("$defs", {}))
            schemas[body.__name__] = schema
            op["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body.__name__}"}}}}
        paths.setdefault(path, {})[method] = op
    return {
        "openapi": "3.1.0",
        "info": {"title": "Shoal gateway", "version": version,
                 "description": "OpenAI-compatible serving API and Shoal's management API."},
        "paths": paths,
        "components": {"schemas": schemas,
                       "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
        "security": [{"bearer": []}],
    }
