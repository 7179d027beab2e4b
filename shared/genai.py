"""Span attributes of an inference under the OpenTelemetry GenAI semantic conventions
(gen_ai.request.*, gen_ai.response.*, gen_ai.usage.*), shared by the gateway's span and the
engine's, so a trace backend reads Shoal's requests as it reads any other LLM server's.
"""

from __future__ import annotations

from collections.abc import Iterable

from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as ga
from opentelemetry.util.types import AttributeValue

from shoal.shared.schemas.infer import GenerateRequest, Usage

Attributes = dict[str, AttributeValue]
PROVIDER = "shoal"


def operation_name(req: GenerateRequest) -> str:
    return "chat" if req.messages is not None else "text_completion"


def request_attributes(req: GenerateRequest, stream: bool | None = None) -> Attributes:
    s = req.sampling
    attrs: Attributes = {ga.GEN_AI_OPERATION_NAME: operation_name(req),
                         ga.GEN_AI_PROVIDER_NAME: PROVIDER, ga.GEN_AI_REQUEST_MODEL: req.model,
                         ga.GEN_AI_REQUEST_TEMPERATURE: s.temperature,
                         ga.GEN_AI_REQUEST_TOP_P: s.top_p,
                         ga.GEN_AI_REQUEST_CHOICE_COUNT: s.n}
    optional = {ga.GEN_AI_REQUEST_MAX_TOKENS: s.max_tokens, ga.GEN_AI_REQUEST_SEED: s.seed,
                ga.GEN_AI_REQUEST_TOP_K: s.top_k if s.top_k and s.top_k > 0 else None,
                ga.GEN_AI_REQUEST_FREQUENCY_PENALTY: s.frequency_penalty or None,
                ga.GEN_AI_REQUEST_PRESENCE_PENALTY: s.presence_penalty or None,
                ga.GEN_AI_REQUEST_STOP_SEQUENCES: list(s.stop) if s.stop else None,
                ga.GEN_AI_REQUEST_STREAM: stream}
    attrs.update({k: v for k, v in optional.items() if v is not None})
    return attrs


def response_attributes(usage: Usage | None, finish_reasons: Iterable[str],
                        response_id: str | None = None, model: str | None = None) -> Attributes:
    attrs: Attributes = {ga.GEN_AI_RESPONSE_FINISH_REASONS: list(finish_reasons)}
    if usage is not None:
        attrs[ga.GEN_AI_USAGE_INPUT_TOKENS] = usage.prompt_tokens
        attrs[ga.GEN_AI_USAGE_OUTPUT_TOKENS] = usage.completion_tokens
        attrs[ga.GEN_AI_USAGE_CACHE_READ_INPUT_TOKENS] = usage.cached_tokens
    if response_id is not None:
        attrs[ga.GEN_AI_RESPONSE_ID] = response_id
    if model is not None:
        attrs[ga.GEN_AI_RESPONSE_MODEL] = model
    return attrs


def pooling_attributes(operation: str, model: str, inputs: int,
                       encoding_format: str | None = None,
                       dimensions: int | None = None) -> Attributes:
    """A pooling request's span (vLLM's name for models answering with vectors or scores):
    `operation` is the conventions' "embeddings", or "rerank" / "score" (none is defined for a
    cross-encoder's scores; the conventions allow a system's own). `inputs`: texts or pairs."""
    attrs: Attributes = {ga.GEN_AI_OPERATION_NAME: operation, ga.GEN_AI_PROVIDER_NAME: PROVIDER,
                         ga.GEN_AI_REQUEST_MODEL: model, "shoal.request.inputs": inputs}
    if encoding_format is not None:
        attrs[ga.GEN_AI_REQUEST_ENCODING_FORMATS] = [encoding_format]
    if dimensions is not None:
        attrs[ga.GEN_AI_EMBEDDINGS_DIMENSION_COUNT] = dimensions
    return attrs


def pooling_result_attributes(input_tokens: int, model: str) -> Attributes:
    return {ga.GEN_AI_USAGE_INPUT_TOKENS: input_tokens, ga.GEN_AI_RESPONSE_MODEL: model}
