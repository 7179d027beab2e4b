"""OpenAI's response objects as pydantic models (pure): what the gateway answers, named as the
openai SDK's types and vLLM's protocol name their fields, so /openapi.json describes every answer
and the SDKs parse it. builders.py and routes.py fill them in (embeddings.py has its own).

Fields OpenAI leaves out when they do not apply are left out here too (`Sparse`): a streamed
delta carries only what changed, a tool call's later deltas only their arguments, a chunk has
`usage` only with `stream_options.include_usage`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict

FinishReason = str
""""stop", "length", "tool_calls" (OpenAI's), or "abort" (vLLM's: the request was cancelled)."""


class OpenAIObject(BaseModel):
    """Every field is sent (None as null), unless the model is `Sparse`. Serialised with
    `exclude_unset` (as vLLM does), each object marking the fields it always sends as set."""

    model_config = ConfigDict(extra="forbid")
    sparse: ClassVar[bool] = False
    _always: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        cls._always = frozenset(name for name, f in cls.model_fields.items()
                                if not cls.sparse or f.is_required() or f.default is not None)

    def model_post_init(self, context: Any) -> None:
        self.__pydantic_fields_set__.update(self._always)

    def body(self) -> dict[str, Any]:
        """The JSON object sent to the client."""
        return self.model_dump(mode="json", exclude_unset=True)

    def body_json(self) -> bytes:
        """The same, as compact UTF-8 JSON (what an SSE event carries)."""
        return self.model_dump_json(exclude_unset=True).encode()


class Sparse(OpenAIObject):
    """A model whose None fields are left out of the JSON unless they were given (OpenAI's
    streamed deltas): a field given explicitly, None included, is sent."""

    sparse: ClassVar[bool] = True


# ---------------------------------------------------------------- usage and logprobs
class PromptTokensDetails(OpenAIObject):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache."""


class CompletionTokensDetails(OpenAIObject):
    reasoning_tokens: int = 0


class UsageInfo(Sparse):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None
    """Only from a model served with --reasoning-parser (its reasoning_tokens)."""


class TopLogprob(OpenAIObject):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(OpenAIObject):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(OpenAIObject):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


# ---------------------------------------------------------------- chat
class FunctionCall(OpenAIObject):
    name: str
    arguments: str
    """A JSON text, as the model wrote it."""


class ToolCall(OpenAIObject):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Sparse):
    """The assistant's answer; `tool_calls` only when it called tools, `reasoning_content` only
    with a reasoning parser."""

    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(OpenAIObject):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason


class ChatCompletion(OpenAIObject):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo | None


class DeltaFunctionCall(Sparse):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(Sparse):
    """A call's first delta has its id, type and name; the later ones only arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class DeltaMessage(Sparse):
    """What a streamed chunk adds to a choice (the first one of a choice names the role)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(OpenAIObject):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(Sparse):
    """One server-sent event of a streamed chat completion; `choices` is empty on the closing
    usage chunk."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- completions
class CompletionChoice(OpenAIObject):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    """vLLM's: the stop string or token id that ended the choice (None: EOS or a limit)."""


class Completion(OpenAIObject):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None


class CompletionChunk(Completion):
    """One server-sent event of a streamed completion: a `text_completion` too, whose `usage`
    comes only with `stream_options.include_usage`."""

    sparse: ClassVar[bool] = True
    usage: UsageInfo | None = None


# ---------------------------------------------------------------- models, tokens, errors
class ModelCard(OpenAIObject):
    """vLLM's model card for a name a model answers to."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "shoal"
    root: str
    """The model this name serves (an alias's model)."""
    parent: str | None = None
    max_model_len: int | None
    """What the engines serve (the model's config when it was not set)."""
    has_running_instance: bool


class ModelList(OpenAIObject):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(OpenAIObject):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(OpenAIObject):
    prompt: str


class ErrorInfo(OpenAIObject):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(OpenAIObject):
    """Every failure's body (a streamed error event adds its HTTP `status`)."""

    error: ErrorInfo
