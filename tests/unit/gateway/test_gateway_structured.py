"""response_format, vLLM's guided_* / structured_outputs, tools and tool_choice: what reaches the
engine, the 400s (naming the param), and tool calls in the chat answer, streamed or whole."""

from __future__ import annotations

import json

import pytest

from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from shoal.services.gateway.openai.builders import ChatResponseBuilder
from shoal.services.gateway.openai.structured import rename_param
from shoal.services.gateway.openai.tools import ToolMode
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import ChoiceDelta

MSG = [{"role": "user", "content": "weather?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {
        "zone": {"$ref": "#/$defs/zone"}}, "$defs": {"zone": {"enum": ["CET", "UTC"]}}}}}


def chat(**fields: object) -> ChatCompletionRequest:
    return parse_body(json.dumps({"model": "m", "messages": MSG, **fields}).encode(),
                      ChatCompletionRequest)


def spec_of(body: ChatCompletionRequest | CompletionRequest) -> dict[str, object]:
    request = body.generate("r") if isinstance(body, ChatCompletionRequest) else \
        body.generate("r", "hi")
    options = request.sampling.structured_outputs
    assert options is not None
    return options.model_dump(exclude_defaults=True)


@pytest.mark.parametrize("fields,expected", [
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"name": "w", "schema": SCHEMA, "strict": True}}},
     {"json": SCHEMA}),
    ({"response_format": {"type": "json_object"}}, {"json_object": True}),
    ({"guided_json": SCHEMA}, {"json": SCHEMA}),
    ({"guided_json": json.dumps(SCHEMA)}, {"json": json.dumps(SCHEMA)}),
    ({"guided_regex": "[0-9]+"}, {"regex": "[0-9]+"}),
    ({"guided_choice": ["yes", "no"]}, {"choice": ["yes", "no"]}),
    ({"guided_grammar": 'root ::= "a"'}, {"grammar": 'root ::= "a"'}),
    ({"structured_outputs": {"regex": "a+", "disable_any_whitespace": True}},
     {"regex": "a+", "disable_any_whitespace": True}),
])
def test_each_source_becomes_the_engine_spec(fields, expected) -> None:
    assert spec_of(chat(**fields)) == expected
    completion = parse_body(json.dumps({"model": "m", "prompt": "p", **fields}).encode(),
                            CompletionRequest)
    assert spec_of(completion) == expected


def test_text_format_and_no_format_constrain_nothing() -> None:
    for body in (chat(), chat(response_format={"type": "text"})):
        assert body.generate("r").sampling.structured_outputs is None


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a", "structural_tag": "x"}},
     "structured_outputs.structural_tag"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "required", "guided_json": SCHEMA}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools.0.function.name"),
    ({"tools": [TIME, {"type": "function", "function": {
        "name": "other", "parameters": {"$defs": {"zone": {"type": "string"}}}}}],
      "tool_choice": "required"}, "tools"),
])
def test_bad_input_is_a_400_naming_the_param(fields, param) -> None:
    with pytest.raises(InvalidRequest) as err:
        chat(**fields)
    assert err.value.param == param and err.value.http_status == 400


def test_named_tool_choice_guides_by_the_function_parameters() -> None:
    body = chat(tools=[WEATHER, TIME],
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    request = body.generate("r")
    assert spec_of(body) == {"json": SCHEMA} and body.spec()[1] == "tools.0.function.parameters"
    assert request.tools is not None and [t.function.name for t in request.tools] == \
        ["get_weather", "get_time"]
    assert not request.needs_tool_call_parser and request.sampling.skip_special_tokens
    assert body.tool_plan().mode == ToolMode("named", "get_weather")


def test_required_tool_choice_is_an_array_of_calls_anyof_the_tools() -> None:
    body = chat(tools=[WEATHER, TIME], tool_choice="required")
    schema = spec_of(body)["json"]
    assert isinstance(schema, dict)
    assert schema["type"] == "array" and schema["minItems"] == 1
    variants = schema["items"]["anyOf"]
    assert [v["properties"]["name"]["enum"] for v in variants] == [["get_weather"], ["get_time"]]
    assert variants[0]["properties"]["parameters"] == SCHEMA
    assert schema["$defs"] == {"zone": {"enum": ["CET", "UTC"]}}
    assert "$defs" not in variants[1]["properties"]["parameters"]
    assert "$defs" in TIME["function"]["parameters"]  # the request's tools are left as sent


def test_auto_is_the_default_with_tools_and_none_is_plain() -> None:
    auto = chat(tools=[WEATHER]).generate("r")
    assert auto.needs_tool_call_parser and not auto.sampling.skip_special_tokens
    assert auto.sampling.structured_outputs is None and auto.tools is not None
    plain = chat(tools=[WEATHER], tool_choice="none")
    assert plain.tool_plan().mode is None and not plain.generate("r").needs_tool_call_parser
    assert plain.generate("r").tools is not None  # the template still sees them


def test_tool_turns_reach_the_engine() -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    body = chat(tools=[WEATHER], tool_choice="none", messages=[
        *MSG, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}])
    messages = body.generate("r").messages
    assert messages is not None and messages[1].tool_calls is not None
    assert messages[1].tool_calls[0].function.arguments == '{"city": "Paris"}'
    assert messages[2].tool_call_id == "call_1" and messages[2].content == "sunny"


def test_engine_errors_name_the_field_the_client_sent() -> None:
    exc = rename_param(InvalidRequest("invalid structured_outputs.json: Unsupported type",
                                      param="structured_outputs.json"),
                       "response_format.json_schema.schema")
    assert exc.param == "response_format.json_schema.schema"
    assert exc.message == "invalid response_format.json_schema.schema: Unsupported type"
    same = rename_param(InvalidRequest("x", param="structured_outputs.regex"), "structured_outputs")
    assert same.param == "structured_outputs.regex"
    other = rename_param(InvalidRequest("x", param="max_tokens"), "guided_json")
    assert other.param == "max_tokens"


# ------------------------------------------------------------------ answers with tool calls
def delta(text: str, finish: str | None = None, index: int = 0) -> ChoiceDelta:
    return ChoiceDelta(index=index, text=text, token_ids=[1], finish_reason=finish)


def test_named_call_streams_deltas_and_answers_with_tool_calls() -> None:
    b = ChatResponseBuilder("m", tool_mode=ToolMode("named", "get_weather"))
    first = b.apply(delta('{"city": '), 0).body()["delta"]
    call = first["tool_calls"][0]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": '}
    last = b.apply(delta('"Paris"}', finish="stop"), 0).body()
    assert last["delta"] == {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}
    assert last["finish_reason"] == "tool_calls"
    message = b.final().body()["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}


def test_hermes_calls_need_the_parser_from_the_first_reply_and_close_on_the_end() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    b = ChatResponseBuilder("m", tool_mode=ToolMode("auto"))
    b.learn_parser("hermes")
    for index in (0, 1):  # n = 2: each choice has its own parser
        held = b.apply(delta(text[:20], index=index), index)
        assert held.body()["delta"] == {} and not b.worth_sending(held)
        entry = b.apply(delta(text[20:], index=index), index).body()
        assert entry["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    closing = b.finish(0, "stop")
    assert closing is not None and closing.finish_reason == "tool_calls"
    final = b.final().body()["choices"]
    assert [c["finish_reason"] for c in final] == ["tool_calls", "tool_calls"]
    assert json.loads(final[1]["message"]["tool_calls"][0]["function"]["arguments"]) == \
        {"city": "Oslo"}


def test_auto_without_a_call_is_a_plain_answer_and_length_stays_length() -> None:
    b = ChatResponseBuilder("m", tool_mode=ToolMode("auto"))
    b.learn_parser("hermes")
    b.apply(delta("It is sunny <"), 0)
    b.apply(delta("3", finish="stop"), 0)
    assert b.final().body()["choices"][0]["message"] == {"role": "assistant",
                                                         "content": "It is sunny <3"}
    r = ChatResponseBuilder("m", tool_mode=ToolMode("required"))
    r.apply(delta('[{"name": "get_weather", "parameters": {"ci', finish="length"), 0)
    choice = r.final().body()["choices"][0]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert choice["message"]["content"].startswith('[{"name"')
