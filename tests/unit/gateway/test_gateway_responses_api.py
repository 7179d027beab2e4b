"""OpenAI's Responses API as a translation onto chat (gateway/responses_api/): input items and
stored history become the chat request meaning the same, and chat answers become Responses and
streamed events that the openai SDK's own types validate and its `responses.stream` helper
assembles."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai.types.responses import Response as SdkResponse
from openai.types.responses import ResponseStreamEvent as SdkEvent
from pydantic import TypeAdapter

from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.management.openapi import openapi_document
from shoal.services.gateway.openai.builders import ChatResponseBuilder
from shoal.services.gateway.openai.tools import ToolMode
from shoal.services.gateway.responses_api.answer import Output, ResponseStream, response_object
from shoal.services.gateway.responses_api.protocol import ResponsesRequest
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import ChoiceDelta, Usage

EVENTS = TypeAdapter(SdkEvent)
TOOL = {"type": "function", "name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def parse(**fields: Any) -> ResponsesRequest:
    return parse_body(json.dumps({"model": "m", **fields}).encode(), ResponsesRequest)


def test_instructions_history_and_items_become_one_chat() -> None:
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    body = parse(instructions="Be brief.", max_output_tokens=9, temperature=0, tools=[TOOL],
                 input=[{"role": "user", "content": [{"type": "input_text", "text": "Paris?"}]},
                        {"type": "function_call", "call_id": "c1", "name": "get_weather",
                         "arguments": '{"city": "Paris"}'},
                        {"type": "function_call", "call_id": "c2", "name": "get_weather",
                         "arguments": '{"city": "Lyon"}'},
                        {"type": "function_call_output", "call_id": "c1", "output": "18C"},
                        {"type": "reasoning", "id": "r1", "summary": []}])
    chat = body.to_chat(history)
    wire = chat.wire_messages()
    assert [m.role for m in wire] == ["system", "user", "assistant", "user", "assistant", "tool"]
    assert wire[0].content == "Be brief." and wire[3].content == "Paris?"
    assert [c.id for c in wire[4].tool_calls] == ["c1", "c2"]
    assert (wire[5].tool_call_id, wire[5].content) == ("c1", "18C")
    assert chat.generate("r").sampling.max_tokens == 9 and chat.tool_plan().mode.kind == "auto"


def test_a_string_input_is_one_user_message_and_store_defaults_true() -> None:
    body = parse(input="Hi", text={"format": {"type": "json_schema", "name": "x",
                                              "schema": {"type": "object"}}})
    assert body.store and body.turn_messages() == [{"role": "user", "content": "Hi"}]
    assert body.to_chat([]).spec()[1] == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequest):  # a tool choice and an output format at once
        parse(input="Hi", tool_choice={"type": "function", "name": "get_weather"},
              tools=[TOOL], text={"format": {"type": "json_object"}})
    assert parse(input="Hi", tool_choice="required", tools=[TOOL]).to_chat(
        []).tool_plan().mode.kind == "required"


@pytest.mark.parametrize("fields,param", [
    ({"input": []}, "input"), ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"), ({}, "input")])
def test_bad_requests_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse(**fields)
    assert caught.value.param == param, caught.value.message


def run(texts: list[str], finish: str, mode: ToolMode | None = None,
        reasoning: str | None = None) -> tuple[ChatResponseBuilder, list[Any]]:
    builder = ChatResponseBuilder("m", tool_mode=mode, reasoning_parser=reasoning)
    entries = []
    for i, text in enumerate(texts):
        last = i == len(texts) - 1
        entry = builder.apply(ChoiceDelta(index=0, text=text, token_ids=[1],
                                          finish_reason=finish if last else None), 0)
        if builder.worth_sending(entry):
            entries.append(builder.with_role(entry))
    builder.usage = Usage(prompt_tokens=10, completion_tokens=len(texts), cached_tokens=2)
    return builder, entries


def streamed(body: ResponsesRequest, builder: ChatResponseBuilder, entries: list[Any]
             ) -> tuple[bytes, dict[str, Any], Output]:
    events = ResponseStream(req=body, id="resp_1", model="m")
    raw = events.start() + b"".join(events.feed([e]) for e in entries)
    state = builder.choices[0]
    closing, done = events.finish(state.finish_reason, builder.usage, state.reasoning_tokens)
    return raw + closing + events.completed(done), done, events.output


def decode(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for block in raw.decode().split("\n\n")[:-1]:
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == f"event: {event['type']}"
        EVENTS.validate_python(event)
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


async def sdk_final(raw: bytes) -> Any:
    """What the openai SDK's `responses.stream` helper makes of these bytes over HTTP."""
    async def serve(request: web.Request) -> web.Response:
        return web.Response(body=raw, headers={"Content-Type": "text/event-stream"})

    app = web.Application()
    app.router.add_post("/v1/responses", serve)
    async with TestServer(app) as server:
        client = openai.AsyncOpenAI(api_key="k", base_url=str(server.make_url("/v1")),
                                    max_retries=0)
        async with client.responses.stream(model="m", input="Hi") as stream:
            return await stream.get_final_response()


async def test_streamed_text_in_openais_order_and_the_sdk_assembles_it() -> None:
    body = parse(input="Hi")
    builder, entries = run(["Hel", "lo"], "stop")
    raw, done, output = streamed(body, builder, entries)
    kinds = [e["type"] for e in decode(raw)]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta",
                     "response.output_text.delta", "response.output_text.done",
                     "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    final = await sdk_final(raw)
    assert final.output_text == "Hello" and final.status == "completed"
    assert final.usage.input_tokens == 10 and final.usage.input_tokens_details.cached_tokens == 2
    SdkResponse.model_validate(done)
    assert output.assistant_message() == {"role": "assistant", "content": "Hello"}


async def test_streamed_function_call_and_a_cut_answer() -> None:
    body = parse(input="Weather?", tools=[TOOL],
                 tool_choice={"type": "function", "name": "get_weather"})
    builder, entries = run(['{"city": ', '"Paris"}'], "stop", ToolMode("named", "get_weather"))
    raw, done, output = streamed(body, builder, entries)
    final = await sdk_final(raw)
    (call,) = final.output
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"})
    assert output.assistant_message()["tool_calls"][0]["id"] == call.call_id
    cut = response_object(parse(input="x", max_output_tokens=1), "resp_2", "m", 0,
                          Output(text="Hi"), "length", builder.usage)
    sdk = SdkResponse.model_validate(cut)
    assert sdk.status == "incomplete" and sdk.incomplete_details.reason == "max_output_tokens"


def test_openapi_documents_the_responses_routes() -> None:
    paths = openapi_document("t")["paths"]
    assert set(paths["/v1/responses/{id}"]) == {"get", "delete"}
    ok = paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"]["$ref"].endswith("/ResponseObject")


async def test_a_reasoning_models_reasoning_is_a_reasoning_item() -> None:
    builder, entries = run(["<think>Capital", " of France.</think>", "Paris."], "stop",
                           reasoning="deepseek_r1")
    raw, done, output = streamed(parse(input="Hi"), builder, entries)
    kinds = [e["type"] for e in decode(raw)]
    assert kinds[2:4] == ["response.output_item.added", "response.reasoning_text.delta"]
    assert "response.reasoning_text.done" in kinds
    final = await sdk_final(raw)
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == "Capital of France."
    assert final.output_text == "Paris." and final.usage.output_tokens_details.reasoning_tokens == 2
    assert output.assistant_message() == {"role": "assistant", "content": "Paris."}
