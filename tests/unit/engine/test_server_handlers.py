"""The engine's NATS adapter, its tool part (no network): tools reach the chat template, tool call
arguments reach it as dicts, and "auto" tool choice is refused without a tool call parser."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.server.handlers import EngineHandlers
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import (ChatMessage, DetokenizeRequest, FunctionCall,
                                        FunctionDefinition,
                                        GenerateRequest, TokenizeRequest, ToolCall,
                                        ToolDefinition)

TOOL = ToolDefinition(function=FunctionDefinition(
    name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}))


class RecordingTokenizer:
    """apply_chat_template records what the template would see."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> str:
        self.calls.append({"messages": messages, **kwargs})
        return "rendered"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        assert text == "rendered" and not add_special_tokens
        return [1, 2, 3]


def handlers(parser: str | None = None) -> tuple[EngineHandlers, RecordingTokenizer]:
    tokenizer = RecordingTokenizer()
    engine = SimpleNamespace(core=SimpleNamespace(config=SimpleNamespace(tool_call_parser=parser,
                                                                         chat_template=None)))
    inputs = InputProcessor(tokenizer=tokenizer, max_model_len=1000)
    adapter = EngineHandlers(bus=None, engine=engine,  # type: ignore[arg-type]
                             instance_id="i", model_name="m", tokenizer=tokenizer, inputs=inputs)
    return adapter, tokenizer


def test_tools_and_tool_turns_reach_the_chat_template() -> None:
    h, tokenizer = handlers()
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather",
                                                       arguments='{"city": "Paris"}'))
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny")]
    assert h.prompt_token_ids(GenerateRequest(request_id="r", model="m", messages=messages,
                                              tools=[TOOL])) == [1, 2, 3]
    seen = tokenizer.calls[0]
    assert seen["tools"] == [{"type": "function", "function": {
        "name": "get_weather", "parameters": TOOL.function.parameters}}]
    assert seen["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    assert seen["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}
    h.prompt_token_ids(TokenizeRequest(model="m", messages=messages[:1]))
    assert tokenizer.calls[1]["tools"] is None


def test_a_turn_without_content_reaches_the_template_as_empty_text() -> None:
    """Clients send the assistant's tool-call turn back with content null; templates read
    message['content'] (SmolLM2's: "'dict object' has no attribute 'content'"), so every message
    carries it, "" for none, as vLLM renders it."""
    h, tokenizer = handlers()
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments="{}"))
    messages = [ChatMessage(role="user", content="weather?"),
                ChatMessage(role="assistant", content=None, tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
                ChatMessage(role="assistant")]
    h.prompt_token_ids(GenerateRequest(request_id="r", model="m", messages=messages,
                                       tools=[TOOL]))
    seen = tokenizer.calls[0]["messages"]
    assert [m["content"] for m in seen] == ["weather?", "", "sunny", ""]
    assert seen[1]["tool_calls"][0]["function"]["arguments"] == {}


def test_auto_tool_choice_needs_a_parser() -> None:
    request = GenerateRequest(request_id="r", model="m", messages=[], tools=[TOOL],
                              needs_tool_call_parser=True)
    with pytest.raises(InvalidRequest) as err:
        handlers(parser=None)[0].tool_call_parser(request)
    assert err.value.param == "tool_choice" and "tool_call_parser" in err.value.message
    assert handlers(parser="hermes")[0].tool_call_parser(request) == "hermes"
    plain = GenerateRequest(request_id="r", model="m", messages=[], tools=[TOOL])
    assert handlers(parser="hermes")[0].tool_call_parser(plain) is None


def test_auto_without_a_parser_says_what_vllm_says_and_how_to_serve_one() -> None:
    """Clients that default to tool_choice "auto" (Open-WebUI, CrewAI, opencode) hear vLLM's
    words, which their docs and error classifiers know, and Shoal's ways to set a parser."""
    request = GenerateRequest(request_id="r", model="m", messages=[], tools=[TOOL],
                              needs_tool_call_parser=True)
    with pytest.raises(InvalidRequest) as err:
        handlers(parser=None)[0].tool_call_parser(request)
    message = err.value.message
    assert message.startswith('"auto" tool choice requires --enable-auto-tool-choice and '
                              '--tool-call-parser to be set'), message
    assert "--engine-arg tool_call_parser=hermes" in message and "model m" in message


def test_a_prompt_too_long_for_any_tokenization_is_refused_before_tokenizing() -> None:
    """max_model_len 100, tokens of at most 8 bytes: more than 1,600 bytes (twice 800) cannot
    fit, so the tokenizer (which would fail the test on any other text) is never asked."""
    h, tokenizer = handlers()
    assert h.inputs is not None
    h.inputs.max_model_len = 100
    h.inputs.max_token_bytes = 8
    for req, param in ((TokenizeRequest(model="m", prompt="x" * 1601), "prompt"),
                       (GenerateRequest(request_id="r", model="m", messages=[
                           ChatMessage(role="user", content="é" * 801)]), "messages")):
        with pytest.raises(InvalidRequest) as err:
            h.prompt_token_ids(req)
        assert err.value.param == param and "without tokenizing" in err.value.message
    ok = GenerateRequest(request_id="r", model="m",
                         messages=[ChatMessage(role="user", content="x" * 1600)])
    assert h.prompt_token_ids(ok) == [1, 2, 3] and not tokenizer.calls[0]["tools"]


async def test_an_answer_the_bus_cannot_carry_is_a_413_reply() -> None:
    """NATS refuses a message over its max_payload (nats-py raises MaxPayloadError before
    sending): the engine answers the request with a small 413 error instead of nothing, so the
    gateway does not wait for a reply that never comes."""
    from nats.errors import MaxPayloadError

    from shoal.shared.errors import PayloadTooLarge
    from shoal.shared.schemas.infer import InferRequestEnvelope

    errors: list[Exception] = []

    class Bus:
        nc = SimpleNamespace(max_payload=64)

        async def respond_error(self, msg: Any, exc: Exception) -> None:
            errors.append(exc)

    class Msg:
        data = InferRequestEnvelope(request=TokenizeRequest(model="m", prompt="hi")
                                    ).model_dump_json().encode()
        reply = "inbox"

        async def respond(self, data: bytes) -> None:
            raise MaxPayloadError

    h, _ = handlers()
    h.bus = Bus()  # type: ignore[assignment]
    h.engine.core.max_model_len = 100
    h.tokenizer.encode = lambda text, add_special_tokens=True: list(range(100))  # type: ignore
    await h.on_request(Msg())  # type: ignore[arg-type]
    await asyncio.gather(*h.lookup_tasks)  # answered on the lookups thread
    assert len(errors) == 1 and isinstance(errors[0], PayloadTooLarge)
    assert errors[0].http_status == 413 and "at most 64 bytes" in errors[0].message


def test_detokenize_takes_at_most_max_model_len_tokens() -> None:
    """A million ids held the GIL (so the engine's event loop) for seconds in decode."""
    h, _ = handlers()
    h.inputs.max_model_len = 4  # the input processor owns the bound (InputProcessor.detokenize)
    h.engine.core.vocab_bound = 100
    with pytest.raises(InvalidRequest) as err:
        h.detokenize(DetokenizeRequest(model="m", tokens=[1] * 5))
    assert err.value.param == "tokens" and "at most 4" in err.value.message


def test_the_reasoning_parser_is_named_for_chat_requests_only() -> None:
    h, _ = handlers()
    chat = GenerateRequest(request_id="r", model="m",
                           messages=[ChatMessage(role="user", content="hi")])
    assert h.reasoning_parser_for(chat, "qwen3") == "qwen3"
    assert h.reasoning_parser_for(chat, None) is None
    plain = GenerateRequest(request_id="r", model="m", prompt="hi")
    assert h.reasoning_parser_for(plain, "qwen3") is None


async def test_lora_names_resolve_with_stable_ids_and_unknown_ones_are_404() -> None:
    from shoal.shared.errors import NotFound
    from shoal.shared.schemas.registry import LoRAModule

    h, _ = handlers()
    spec = [LoRAModule(name="sql", path="/a/sql"), LoRAModule(name="chat", path="/a/chat")]
    reads: list[int] = []

    async def source() -> list[LoRAModule]:  # the registry's lora_modules now
        reads.append(1)
        return spec

    h.set_loras(spec[:1])
    h.lora_source = source
    sql = await h.lora_request("sql")
    assert (sql.lora_name, sql.lora_int_id, sql.lora_path) == ("sql", 1, "/a/sql") and not reads
    chat = await h.lora_request("chat")  # loaded at runtime: one reread finds it
    assert chat.lora_int_id == 2 and len(reads) == 1
    assert await h.lora_request("sql") is sql and await h.lora_request(None) is None
    spec[0] = LoRAModule(name="sql", path="/b/sql")  # another folder under the name: a new id
    h.set_loras(spec)
    assert (await h.lora_request("sql")).lora_int_id == 3
    with pytest.raises(NotFound, match="The lora adapter 'nope' cannot be found."):
        await h.lora_request("nope")


class ThreadTokenizer:
    """encode records the thread it ran on (and may wait there, to keep the thread busy)."""

    def __init__(self, hold: threading.Event | None = None) -> None:
        self.threads: list[str] = []
        self.hold = hold

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        if self.hold is not None and text.startswith("long"):
            self.hold.wait(10)
        return [len(text)]


async def test_short_prompts_tokenize_on_the_loop_and_long_or_queued_ones_on_the_thread() -> None:
    hold = threading.Event()
    tokenizer = ThreadTokenizer(hold)
    h, _ = handlers()
    h.inputs = InputProcessor(tokenizer=tokenizer, max_model_len=100_000)
    loop_thread = threading.current_thread().name
    req = GenerateRequest(request_id="r", model="m", prompt="short")
    assert await h.tokenize_prompt(req) == [5]
    long_req = GenerateRequest(request_id="l", model="m", prompt="long" + "x" * 9000)
    long_job = asyncio.create_task(h.tokenize_prompt(long_req))
    await asyncio.sleep(0.05)
    short_job = asyncio.create_task(h.tokenize_prompt(req))  # the thread is busy: it queues
    await asyncio.sleep(0.05)
    assert not short_job.done()
    hold.set()
    assert await long_job == [9004] and await short_job == [5]
    assert tokenizer.threads[0] == loop_thread
    assert all(t.startswith("tokenize") for t in tokenizer.threads[1:])
    assert await h.tokenize_prompt(req) == [5] and tokenizer.threads[-1] == loop_thread
