"""OpenAI request models (completions, chat, tokenize) and their translation to the bus contract.

Pure: pydantic only. Every bad input becomes InvalidRequest naming the offending `param`, so the
gateway answers 400 with OpenAI's error shape before anything reaches an engine.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from shoal.services.gateway.json_body import parse_body  # noqa: F401 - where callers import it
from shoal.services.gateway.openai.body import MAX_INT32, Body, TokenId
from shoal.services.gateway.openai.structured import StructuredFields
from shoal.services.gateway.openai.tools import (
    ToolBody, ToolCallIn, ToolChoice, ToolPlan, plan_tools
)
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import (
    ChatMessage, GenerateRequest, SamplingOptions, StructuredOutputsOptions
)

MAX_LOGPROBS = 20


def check_logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's shape: keys are token ids (as strings), values in [-100, 100]; the engine checks
    the ids against its vocabulary (a 400 naming logit_bias too)."""
    checked = {}
    for key, value in (bias or {}).items():
        if not (key.isascii() and key.isdigit()) or int(key) > MAX_INT32:
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key[:40]!r}",
                                 param="logit_bias")
        if not -100 <= value <= 100:
            raise InvalidRequest(f"logit_bias values must be in [-100, 100], got {value}",
                                 param="logit_bias")
        checked[int(key)] = value
    return checked or None


class StreamOptions(Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingBody(StructuredFields):
    """Fields shared by completions and chat (OpenAI's, plus vLLM's extra sampling knobs and
    structured outputs)."""

    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=MAX_INT32)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**63)
    user: str | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_INT32)
    stop_token_ids: list[TokenId] | None = None
    logit_bias: dict[str, float] | None = None
    """token id (a string, as JSON keys are) -> bias in [-100, 100]: check_logit_bias"""
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """vLLM's stream_options.continuous_usage_stats: usage so far on every streamed chunk."""
        return self.include_usage and bool(self.stream_options
                                           and self.stream_options.continuous_usage_stats)

    def spec(self) -> tuple[StructuredOutputsOptions | None, str | None]:
        """The output constraint and the request field it came from (for a 400's param)."""
        return self.structured_spec()

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> SamplingOptions:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stops):
            raise InvalidRequest("stop strings must not be empty", param="stop")
        if len(stops) > 16:
            raise InvalidRequest(f"at most 16 stop strings, got {len(stops)}", param="stop")
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 param="stream_options")
        logit_bias = check_logit_bias(self.logit_bias)
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise InvalidRequest(f"min_tokens ({self.min_tokens}) must be <= max_tokens "
                                 f"({max_tokens})", param="min_tokens")
        return SamplingOptions(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=0 if self.top_k in (None, -1) else self.top_k,
            min_p=self.min_p or 0.0, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            seed=self.seed, stop=stops, stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos, max_tokens=max_tokens, min_tokens=self.min_tokens,
            logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.spec()[0], logit_bias=logit_bias,
        )


class CompletionRequest(_SamplingBody):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the (possibly batched) request."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def check(self) -> None:
        self.sampling(self.max_tokens, self.logprobs)
        self.prompts()  # an empty prompt is a 400
        if self.suffix:
            raise InvalidRequest("suffix is not supported", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequest("best_of different from n is not supported", param="best_of")
        if self.echo and self.logprobs is not None:
            raise InvalidRequest("echo with logprobs is not supported", param="echo")

    def generate(self, request_id: str, prompt: str | list[int]) -> GenerateRequest:
        sampling = self.sampling(self.max_tokens, self.logprobs)
        if isinstance(prompt, str):
            return GenerateRequest(request_id=request_id, model=self.model, prompt=prompt,
                                   sampling=sampling)
        return GenerateRequest(request_id=request_id, model=self.model, prompt_token_ids=prompt,
                               sampling=sampling)


class TextPart(Body):
    type: Literal["text"]
    text: str


class ChatMessageIn(Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def text(self) -> str | None:
        """The content as one text; text parts joined by newlines, as vLLM joins them."""
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content


class ChatCompletionRequest(_SamplingBody):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolBody] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    """False: at most one call (the first; "required" is guided to one)."""
    chat_template_kwargs: dict[str, Any] | None = None
    """More variables for the chat template, e.g. {"enable_thinking": false} (vLLM's)."""
    include_reasoning: bool = True
    """vLLM's: false leaves reasoning_content out of a reasoning model's answer."""

    def wire_messages(self) -> list[ChatMessage]:
        return [ChatMessage(role=m.role, content=m.text(), name=m.name, tool_call_id=m.tool_call_id,
                            tool_calls=[c.wire() for c in m.tool_calls] if m.tool_calls else None)
                for m in self.messages]

    def tool_plan(self) -> ToolPlan:
        return plan_tools(self.tools, self.tool_choice, self.parallel_tool_calls is not False)

    def spec(self) -> tuple[StructuredOutputsOptions | None, str | None]:
        plan = self.tool_plan()
        spec, source = self.structured_spec()
        if plan.spec is None:
            return spec, source
        if spec is not None:
            raise InvalidRequest(f"tool_choice {plan.mode and plan.mode.kind} cannot be combined "
                                 f"with {source}", param="tool_choice")
        return plan.spec, plan.spec_param

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs needs logprobs set to true", param="top_logprobs")
        self.generate("validate")

    def generate(self, request_id: str) -> GenerateRequest:
        max_tokens = (self.max_completion_tokens if self.max_completion_tokens is not None
                      else self.max_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        sampling = self.sampling(max_tokens, logprobs)
        is_auto = (mode := self.tool_plan().mode) is not None and mode.kind == "auto"
        if is_auto:  # a parser's tags may be special tokens (vLLM's hermes parser does this too)
            sampling.skip_special_tokens = False
        return GenerateRequest(request_id=request_id, model=self.model,
                               messages=self.wire_messages(),
                               add_generation_prompt=self.add_generation_prompt, sampling=sampling,
                               tools=[t.wire() for t in self.tools] if self.tools else None,
                               needs_tool_call_parser=is_auto,
                               chat_template_kwargs=self.chat_template_kwargs)


class TokenizeBody(Body):
    model: str = Field(min_length=1)
    prompt: str | None = None
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolBody] | None = None
    """Rendered into the chat template, as for a chat request (vLLM's /tokenize does too)."""
    chat_template_kwargs: dict[str, Any] | None = None

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("give exactly one of prompt or messages", param="prompt")


class DetokenizeBody(Body):
    model: str = Field(min_length=1)
    tokens: list[TokenId]
