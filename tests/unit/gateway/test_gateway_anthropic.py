"""Anthropic's Messages API as a translation onto chat (gateway/anthropic/): requests become the
chat request meaning the same, and chat answers become Messages and streamed events that the
`anthropic` SDK's own types validate and its stream accumulator assembles."""

from __future__ import annotations

import json
from typing import Any

import anthropic
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from anthropic.types import Message as SdkMessage
from anthropic.types import MessageTokensCount as SdkTokensCount
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from shoal.services.gateway.anthropic.answer import (
    MessageStream, error_body, message, stop_reason
)
from shoal.services.gateway.anthropic.objects import MessageTokensCount
from shoal.services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from shoal.services.gateway.errors import error_body as openai_error_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.management.openapi import openapi_document
from shoal.services.gateway.openai.builders import ChatResponseBuilder
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.errors import InvalidRequest, NotFound, Unauthorized
from shoal.shared.schemas.infer import ChoiceDelta, Usage

WEATHER = {"name": "get_weather", "description": "Weather now",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}},
                            "required": ["city"]}}
EVENTS = TypeAdapter(RawMessageStreamEvent)


def parse(body: dict[str, Any], model: type = MessagesRequest) -> Any:
    return parse_body(json.dumps(body).encode(), model)


def base(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 32,
            "messages": [{"role": "user", "content": "Hi"}], **fields}


def test_system_turns_and_sampling_become_the_same_chat() -> None:
    chat = parse(base(system=[{"type": "text", "text": "Be brief."},
                              {"type": "text", "text": "Be kind."}],
                      messages=[{"role": "user", "content": "Hi"},
                                {"role": "assistant", "content": [{"type": "text", "text": "Yo"}]},
                                {"role": "user", "content": [{"type": "text", "text": "a"},
                                                             {"type": "text", "text": "b"}]}],
                      stop_sequences=["\n\n"], temperature=0.5, top_p=0.9, top_k=5,
                      metadata={"user_id": "u1"})).to_chat()
    assert [(m.role, m.text()) for m in chat.messages] == [
        ("system", "Be brief.\nBe kind."), ("user", "Hi"), ("assistant", "Yo"), ("user", "a\nb")]
    sampling = chat.generate("r").sampling
    assert (sampling.max_tokens, sampling.stop, sampling.temperature, sampling.top_p,
            sampling.top_k) == (32, ["\n\n"], 0.5, 0.9, 5)
    assert chat.user == "u1" and not chat.stream


def test_tool_use_and_tool_results_become_tool_calls_and_tool_messages() -> None:
    chat = parse(base(tools=[WEATHER], tool_choice={"type": "any"}, messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "down"}]},
            {"type": "text", "text": "Thanks"}]}])).to_chat()
    wire = chat.wire_messages()
    assert [m.role for m in wire] == ["user", "assistant", "tool", "tool", "user"]
    call = wire[1].tool_calls[0]
    assert (call.id, call.function.name, json.loads(call.function.arguments)) == (
        "toolu_1", "get_weather", {"city": "Paris"})
    assert (wire[2].tool_call_id, wire[2].content) == ("toolu_1", "18C")
    assert (wire[3].tool_call_id, wire[3].content) == ("toolu_2", "Error: down")
    assert chat.tool_plan().mode.kind == "required"
    assert chat.tools[0].function.parameters == WEATHER["input_schema"]


@pytest.mark.parametrize("choice,kind,name", [
    ({"type": "auto"}, "auto", None), ({"type": "none"}, None, None),
    ({"type": "tool", "name": "get_weather"}, "named", "get_weather")])
def test_tool_choice_maps_to_openai(choice: dict[str, Any], kind: str | None,
                                    name: str | None) -> None:
    mode = parse(base(tools=[WEATHER], tool_choice=choice)).to_chat().tool_plan().mode
    assert (mode.kind, mode.function_name) == (kind, name) if kind else mode is None


@pytest.mark.parametrize("fields,param", [
    ({"max_tokens": None}, "max_tokens"), ({"temperature": 1.5}, "temperature"),
    ({"stop_sequences": [""]}, "stop_sequences"), ({"messages": []}, "messages"),
    ({"tool_choice": {"type": "tool"}, "tools": [WEATHER]}, "tool_choice.name"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
     "messages.0.content"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role")])
def test_bad_requests_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    body = {k: v for k, v in base(**fields).items() if v is not None}
    with pytest.raises(InvalidRequest) as caught:
        parse(body)
    assert caught.value.param == param, caught.value.message


def test_count_tokens_needs_no_max_tokens() -> None:
    chat = parse({"model": "m", "system": "S", "messages": [{"role": "user", "content": "Hi"}],
                  "tools": [WEATHER]}, CountTokensRequest).to_chat()
    assert [m.role for m in chat.messages] == ["system", "user"] and chat.tools
    SdkTokensCount.model_validate(MessageTokensCount(input_tokens=9).body())


@pytest.mark.parametrize("finish,stop,expected", [
    ("stop", None, ("end_turn", None)), ("stop", 2, ("end_turn", None)),
    ("stop", "\n\n", ("stop_sequence", "\n\n")), ("length", None, ("max_tokens", None)),
    ("tool_calls", None, ("tool_use", None))])
def test_stop_reasons(finish: str, stop: Any, expected: tuple[str, str | None]) -> None:
    assert stop_reason(finish, stop) == expected


def run_builder(texts: list[str], finish: str, mode: ToolMode | None = None,
                reasoning: str | None = None) -> tuple[ChatResponseBuilder, list[Any]]:
    builder = ChatResponseBuilder("m", tool_mode=mode, reasoning_parser=reasoning)
    entries = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        entry = builder.apply(ChoiceDelta(index=0, text=text, token_ids=[1],
                                          finish_reason=finish if last else None,
                                          stop_reason="END" if last and finish == "stop"
                                          else None), 0)
        if builder.worth_sending(entry):
            entries.append(builder.with_role(entry))
    builder.usage = Usage(prompt_tokens=10, completion_tokens=len(texts), cached_tokens=4)
    return builder, entries


def test_whole_message_validates_against_the_sdk() -> None:
    builder, _ = run_builder(["Hello", " there"], "stop")
    state = builder.choices[0]
    body = message(builder.final(), state.stop_reason, builder.usage).body()
    sdk = SdkMessage.model_validate(body)
    assert sdk.content[0].text == "Hello there" and sdk.stop_reason == "stop_sequence"
    assert sdk.stop_sequence == "END" and sdk.id.startswith("msg_")
    assert (sdk.usage.input_tokens, sdk.usage.cache_read_input_tokens,
            sdk.usage.output_tokens) == (6, 4, 2)


def stream_raw(builder: ChatResponseBuilder, entries: list[Any]) -> bytes:
    events = MessageStream(id="msg_1", model="m")
    raw = events.start(10) + b"".join(events.feed([e]) for e in entries)
    state = builder.choices[0]
    return raw + events.finish(state.finish_reason, state.stop_reason, builder.usage)


def stream_events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert name_line == f"event: {data['type']}"
        if data["type"] != "ping":  # not a RawMessageStreamEvent; the SDK skips it
            EVENTS.validate_python(data)
        out.append(data)
    return out


async def accumulate(raw: bytes) -> SdkMessage:
    """What the SDK's own stream helper makes of these bytes (served over HTTP as they are)."""
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=raw, headers={"Content-Type": "text/event-stream"})

    app = web.Application()
    app.router.add_post("/v1/messages", serve)
    async with TestServer(app) as server:
        client = anthropic.AsyncAnthropic(api_key="k", base_url=str(server.make_url("")),
                                          max_retries=0)
        async with client.messages.stream(model="m", max_tokens=8, messages=[
                {"role": "user", "content": "Hi"}]) as stream:
            return await stream.get_final_message()


async def test_streamed_text_comes_in_anthropics_order() -> None:
    builder, entries = run_builder(["Hel", "lo"], "length")
    raw = stream_raw(builder, entries)
    events = stream_events(raw)
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta",
        "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    final = await accumulate(raw)
    assert final.content[0].text == "Hello" and final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 2 and final.usage.input_tokens == 6


async def test_streamed_tool_use_gives_the_sdk_its_input() -> None:
    builder, entries = run_builder(['{"city": ', '"Paris"}'], "stop",
                                   ToolMode("named", "get_weather"))
    raw = stream_raw(builder, entries)
    events = stream_events(raw)
    assert events[1]["content_block"]["type"] == "tool_use"
    assert {e["delta"]["type"] for e in events if e["type"] == "content_block_delta"} == {
        "input_json_delta"}
    final = await accumulate(raw)
    (block,) = final.content
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use"
    whole = message(builder.final(), None, builder.usage)
    assert SdkMessage.model_validate(whole.body()).content[0].input == {"city": "Paris"}


@pytest.mark.parametrize("exc,kind", [
    (InvalidRequest("bad"), "invalid_request_error"), (Unauthorized("no"), "authentication_error"),
    (NotFound("gone"), "not_found_error")])
def test_errors_in_anthropics_shape(exc: Exception, kind: str) -> None:
    status, body = openai_error_body(exc)
    shaped = error_body(status, body["error"]["message"]).body()
    assert shaped == {"type": "error", "error": {"type": kind, "message": str(exc)}}


def test_openapi_documents_the_messages_routes() -> None:
    paths = openapi_document("t")["paths"]
    ok = paths["/v1/messages"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/Message")
    assert "count_tokens" in " ".join(paths)


async def test_a_reasoning_models_thinking_is_a_thinking_block() -> None:
    builder, entries = run_builder(["<think>Capital", " of France.</think>", "Paris."], "stop",
                                   reasoning="deepseek_r1")
    raw = stream_raw(builder, entries)
    kinds = [(e["type"], (e.get("content_block") or e.get("delta") or {}).get("type"))
             for e in stream_events(raw)]
    assert kinds[1:4] == [("content_block_start", "thinking"), ("ping", None),
                          ("content_block_delta", "thinking_delta")]
    final = await accumulate(raw)
    assert [b.type for b in final.content] == ["thinking", "text"]
    assert (final.content[0].thinking, final.content[1].text) == ("Capital of France.", "Paris.")
    whole = SdkMessage.model_validate(message(builder.final(), None, builder.usage).body())
    assert [b.type for b in whole.content] == ["thinking", "text"]


@pytest.mark.parametrize("thinking,enabled", [("disabled", False), ("enabled", True)])
def test_thinking_switches_the_templates_enable_thinking(thinking: str, enabled: bool) -> None:
    chat = parse(base(thinking={"type": thinking, "budget_tokens": 1024})).to_chat()
    assert chat.chat_template_kwargs == {"enable_thinking": enabled}
