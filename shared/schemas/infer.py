"""Inference over the bus: requests on shoal.infer.<instance_id> (or the model's queue group),
replies streamed to the request's inbox.

A generate request is answered by `InferChunk`s (seq 0, 1, 2, ...) and one final `InferEnd`
(finish reasons and usage) or `InferError`; the receiver checks `seq` so a gap or a dead engine is
detected, never silently truncated. The engine tokenizes and applies chat templates, so a gateway
needs no model files. Tokenize / detokenize get one reply each.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field

from shoal.shared.schemas.common import ErrorBody, Wire


class StructuredOutputsOptions(Wire):
    """StructuredOutputsParams on the wire: exactly one of json / regex / choice / grammar /
    json_object (the engine checks it, and that the schema, regex or grammar parses)."""

    model_config = ConfigDict(extra="forbid", serialize_by_alias=True, validate_by_name=True,
                              validate_by_alias=True)

    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    """A JSON schema ("json" on the wire; the name would shadow BaseModel.json)."""
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False


class SamplingOptions(Wire):
    """SamplingParams on the wire (the engine validates them again: InvalidRequest -> 400)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsOptions | None = None
    logit_bias: dict[int, float] | None = None


TOOL_CALL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_xml", "qwen3_coder")
"""The tool-call parsers an engine can be configured with (engine_args tool_call_parser), as
vLLM's --tool-call-parser; the gateway parses "auto" tool choice answers with the instance's
(services/gateway/parsers/tool/; qwen3_coder is qwen3_xml's other name, as in vLLM)."""
REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""vLLM's --reasoning-parser names an engine can be configured with (engine_args
reasoning_parser); the gateway splits chat answers' <think> reasoning with the instance's."""


class FunctionDefinition(Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    """The arguments' JSON schema."""
    strict: bool | None = None


class ToolDefinition(Wire):
    """An OpenAI tool, as the chat template receives it."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class FunctionCall(Wire):
    name: str
    arguments: str
    """JSON text (OpenAI's shape); the engine hands templates a dict, as vLLM does."""


class ToolCall(Wire):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Wire):
    role: str
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    """An assistant turn that called tools (sent back by the client in later turns)."""
    tool_call_id: str | None = None
    """A tool turn: the call it answers."""


class UsageTag(Wire):
    """Whose usage a generate request is, for the engine to record should its gateway vanish
    mid-stream (services/engine/server/requesters.py): the key, the admission's reservation
    and a record id the registry counts once."""

    key_id: str
    model: str
    """The name the usage is kept under (the gateway's: an adapter's name for a LoRA request)."""
    reservation_id: str | None = Field(default=None, min_length=1, max_length=32)
    record_id: str = Field(min_length=1, max_length=32)
    requests: int = Field(default=1, ge=0, le=1)
    """1 for the first (or only) generate request of an OpenAI request, 0 for its others."""


class Resume(Wire):
    """A stream continued on this engine after the one serving it died (the gateway's
    failover): what its client already has of choice 0, as output the engine resumes from
    (max_tokens, min_tokens, penalties, stop strings and a seeded generator carry on), never
    sent again."""

    token_ids: list[int]
    text: str = ""


class GenerateRequest(Wire):
    op: Literal["generate"] = "generate"
    request_id: str = Field(min_length=1, max_length=128)
    model: str
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    """Chat: rendered with the model's chat template by the engine."""
    add_generation_prompt: bool = True
    sampling: SamplingOptions = Field(default_factory=SamplingOptions)
    tools: list[ToolDefinition] | None = None
    """Offered to the chat template (apply_chat_template(tools=...))."""
    lora_name: str | None = None
    """The LoRA adapter to run with (one of the model's lora_modules): the gateway sets it when
    the request's `model` names an adapter; the engine answers 404 for one it does not know."""
    needs_tool_call_parser: bool = False
    """tool_choice "auto": the gateway parses tool calls out of the answer with the engine's
    tool_call_parser, named in seq 0; an engine without one refuses (400, param tool_choice)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Chat: more variables for the chat template, e.g. {"enable_thinking": false} (vLLM's)."""
    usage: UsageTag | None = None
    """Set for a key's request: what the engine records if the requester vanishes."""
    resume: Resume | None = None
    """A failover's continuation (n = 1 only): output already delivered by another engine."""


class TokenizeRequest(Wire):
    op: Literal["tokenize"] = "tokenize"
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(Wire):
    op: Literal["detokenize"] = "detokenize"
    model: str
    tokens: list[int]


class EmbedRequest(Wire):
    """Embed texts (tokenized by the engine, special tokens added) or token ids (as given) on an
    embedding model's engine; one EmbedReply."""

    op: Literal["embed"] = "embed"
    model: str
    texts: list[str] | None = None
    token_ids: list[list[int]] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    truncate_prompt_tokens: int | None = None
    """vLLM's: keep at most this many tokens of each input (-1: the model's limit); unset, an
    input over the limit is a 400."""


class EmbedReply(Wire):
    data: str
    """The vectors: base64 of float32 little-endian, row after row (compact on the bus; the
    gateway hands it out as is for encoding_format=base64)."""
    num_inputs: int
    dimensions: int
    prompt_tokens: int


class ScoreRequest(Wire):
    """Score text pairs (text_1[i], text_2[i]) on a cross-encoder's engine (/v1/score,
    /v1/rerank); one ScoreReply. The engine tokenizes each pair as one sequence."""

    op: Literal["score"] = "score"
    model: str
    text_1: list[str]
    text_2: list[str]
    truncate_prompt_tokens: int | None = None
    """As EmbedRequest's, for each pair (the longer text is cut first)."""


class ScoreReply(Wire):
    scores: list[float]
    prompt_tokens: int


InferRequest = Annotated[GenerateRequest | TokenizeRequest | DetokenizeRequest | EmbedRequest
                         | ScoreRequest, Field(discriminator="op")]


class InferRequestEnvelope(Wire):
    request: InferRequest


class TopLogprob(Wire):
    token_id: int
    token: str
    logprob: float


class TokenLogprobWire(Wire):
    token_id: int
    token: str
    logprob: float
    top: list[TopLogprob] = Field(default_factory=list)


class ChoiceDelta(Wire):
    index: int
    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[TokenLogprobWire] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Usage(Wire):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class InferChunk(Wire):
    type: Literal["chunk"] = "chunk"
    request_id: str
    seq: int
    choices: list[ChoiceDelta]
    prompt_token_ids: list[int] | None = None
    """Sent with seq 0 (for echo / prompt logprobs)."""
    prompt_logprobs: list[TokenLogprobWire | None] | None = None
    tool_call_parser: str | None = None
    """Sent with seq 0 of a request that needs_tool_call_parser: the parser to apply."""
    reasoning_parser: str | None = None
    """Sent with seq 0 of a chat request to an instance served with one (REASONING_PARSERS):
    the gateway splits the answer's reasoning from its content with it."""


class InferEnd(Wire):
    type: Literal["end"] = "end"
    request_id: str
    seq: int
    usage: Usage
    finish_reasons: dict[int, str] = Field(default_factory=dict)
    instance_id: str
    ttft_s: float | None = None
    """Engine-side time to first token (queue + prefill), for metrics."""
    queue_s: float | None = None


class InferError(Wire):
    type: Literal["error"] = "error"
    request_id: str
    seq: int
    error: ErrorBody
    status: int


InferReply = Annotated[InferChunk | InferEnd | InferError, Field(discriminator="type")]


class InferReplyEnvelope(Wire):
    reply: InferReply


class TokenizeReply(Wire):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeReply(Wire):
    prompt: str


class AbortRequest(Wire):
    """Published on shoal.abort.<instance_id>: the client went away."""

    request_id: str


class EngineLoad(Wire):
    """Published on shoal.load.<instance_id> a few times a second, for routing and /metrics."""

    instance_id: str
    model_name: str
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    max_num_seqs: int
    max_model_len: int
    # cumulative counters (the gateway exports them under vLLM's names)
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    draining: bool = False
    chat_template_tokens: int = 0
    """What the chat template adds to a one-message chat (its tags, a default system prompt): a
    gateway adds it to its estimate of a chat's prompt when it reserves a key's tokens."""
