"""Structured outputs and tool calls through the whole stack (gateway -> NATS -> engine process
running SmolLM2), driven with the `openai` SDK: response_format json_schema (also through the
SDK's `parse` helper), vLLM's guided_* fields, tool_choice named and "required" (whole and
streamed as tool_call deltas), "auto" with the hermes parser, and the 400s; a reasoning parser
(deepseek_r1) splitting the model's real answer, and chat_template_kwargs reaching the template."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Literal

import httpx
import openai
import pydantic
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.services.gateway.openai.streaming import parse_sse
from shoal.shared.embedded import free_port
from shoal.shared.schemas.registry import ModelCreate
from tests.e2e.test_serving import ENGINE_ARGS, async_api, running_instance, sync_api
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    """test_serving's stack, isolated from the modules before it in the session (they share the
    database): their models are deleted first, and ours run only on this stack's worker (a
    label), never on a worker of theirs that has not yet been seen to stop heartbeating. It
    serves three deployments of SmolLM2: the plain one, one with tool_call_parser=hermes, and one
    with reasoning_parser=deepseek_r1 and a ChatML template that reads enable_thinking."""
    settings = make_settings(servers, tmp_path_factory.mktemp("structured-e2e"), drain_timeout=5.0,
                             engine_restart_max_backoff=2.0, gateway_engine_dead_after=2.0,
                             gateway_port=free_port(None), scheduler_interval=1.0)
    tag = uuid.uuid4().hex[:6]
    worker = {"worker_name": f"real-{tag}", "worker_labels": {"stack": tag}}
    async with running_services(settings, worker=worker, gateway={}, name="structured-e2e",
                                clean=True) as stack:
        client = stack.client
        models = []
        for name, args in ((f"smol-{tag}", ENGINE_ARGS),
                           (f"smol-hermes-{tag}", {**ENGINE_ARGS, "tool_call_parser": "hermes"}),
                           (f"smol-r1-{tag}", {**ENGINE_ARGS, "reasoning_parser": "deepseek_r1",
                                               "chat_template": THINKING_TEMPLATE})):
            models.append(await client.create_model(ModelCreate(
                name=name, source=str(smollm2_gguf_path()), device="cpu", max_model_len=512,
                worker_selector={"stack": tag}, engine_args=args)))
        for model in models:
            await running_instance(client, model.id)
        yield settings, models[0], models[1], stack.url, models[2]


THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
    "not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
"""SmolLM2's ChatML, and Qwen3's switch: enable_thinking false writes an empty think block."""
WEATHER_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 30},
    "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"]}
TIME_ARGS = {"type": "object", "properties": {"zone": {"enum": ["CET", "UTC", "JST"]}},
             "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER_ARGS}},
         {"type": "function", "function": {"name": "get_time", "description": "Time now",
                                           "parameters": TIME_ARGS}}]
ASK = [{"role": "user", "content": "What is the weather in Paris right now?"}]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}


class Person(pydantic.BaseModel):
    name: str
    age: int
    city: Literal["Paris", "London", "Tokyo"]


def check_arguments(name: str, arguments: str) -> None:
    """jsonschema is not installed here: the tools' schemas checked by hand."""
    args = json.loads(arguments)
    if name == "get_weather":
        assert set(args) == {"city", "unit"} and isinstance(args["city"], str)
        assert args["unit"] in ("celsius", "fahrenheit")
    else:
        assert name == "get_time" and args["zone"] in ("CET", "UTC", "JST")


async def test_json_schema_response_format_validates(stack) -> None:
    settings, model, hermes_model, url, _ = stack
    api = sync_api(url)
    reply = await asyncio.to_thread(lambda: api.chat.completions.create(
        model=model.name, temperature=0, max_tokens=80,
        messages=[{"role": "user", "content": "Invent a person, as JSON."}],
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON, "strict": True}}))
    person = json.loads(reply.choices[0].message.content)
    assert set(person) <= {"name", "age"} and isinstance(person["name"], str)
    assert isinstance(person["age"], int) and person["age"] >= 0
    assert reply.choices[0].finish_reason == "stop"
    parsed = await asyncio.to_thread(lambda: api.chat.completions.parse(
        model=model.name, temperature=0, max_tokens=80, response_format=Person,
        messages=[{"role": "user", "content": "Invent a person who lives in a big city."}]))
    assert isinstance(parsed.choices[0].message.parsed, Person)


async def test_guided_fields_of_vllm_constrain_completions(stack) -> None:
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    regex = await api.completions.create(
        model=model.name, prompt="The year the Berlin wall fell:", temperature=0, max_tokens=10,
        extra_body={"guided_regex": r" (19|20)[0-9]{2}"})
    assert re.fullmatch(r" (19|20)[0-9]{2}", regex.choices[0].text), regex.choices[0].text
    choice = await api.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "Is Paris in France?"}],
        temperature=0, max_tokens=5, n=2, extra_body={"guided_choice": ["yes", "no"]})
    assert {c.message.content for c in choice.choices} <= {"yes", "no"}


async def test_named_tool_choice_answers_with_a_tool_call(stack) -> None:
    settings, model, hermes_model, url, _ = stack
    reply = await async_api(url).chat.completions.create(
        model=model.name, messages=ASK, temperature=0, max_tokens=60, tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    check_arguments(call.function.name, call.function.arguments)


async def test_required_tool_choice_calls_the_given_tools(stack) -> None:
    settings, model, hermes_model, url, _ = stack
    reply = await async_api(url).chat.completions.create(
        model=model.name, messages=ASK, temperature=0, max_tokens=120, tools=TOOLS,
        tool_choice="required")
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls
    for call in choice.message.tool_calls:
        check_arguments(call.function.name, call.function.arguments)


@pytest.mark.parametrize("tool_choice", [
    {"type": "function", "function": {"name": "get_time"}}, "required"])
async def test_streamed_tool_call_deltas_add_up_to_the_answer(stack, tool_choice) -> None:
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    args = dict(model=model.name, messages=ASK, temperature=0, max_tokens=120, tools=TOOLS,
                tool_choice=tool_choice)
    whole = (await api.chat.completions.create(**args)).choices[0].message.tool_calls
    chunks = [c async for c in await api.chat.completions.create(**args, stream=True)]
    calls: dict[int, dict[str, str]] = {}
    for chunk in chunks:
        for delta in chunk.choices[0].delta.tool_calls or []:
            if delta.id is not None:  # a call's first delta: its id, type and name
                assert delta.index not in calls and delta.type == "function"
                calls[delta.index] = {"id": delta.id, "name": delta.function.name,
                                      "arguments": ""}
            else:
                assert delta.function.name is None
            calls[delta.index]["arguments"] += delta.function.arguments or ""
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert reasons == ["tool_calls"]
    assert all(not c.choices[0].delta.content for c in chunks)


async def test_bad_structured_requests_are_400s_naming_the_param(stack) -> None:
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    bad = [
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "tool_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "nonsense"}}}}, "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"guided_json": PERSON}},
         "guided_json"),
        ({"extra_body": {"guided_regex": "(unclosed"}}, "guided_regex"),
        ({"tools": TOOLS}, "tool_choice"),  # "auto" on a model without a tool call parser
    ]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=model.name, messages=ASK, max_tokens=5,
                                              **fields)
        assert err.value.status_code == 400 and err.value.param == param, (fields, err.value)


async def test_auto_tool_choice_reads_hermes_tool_calls(stack) -> None:
    """SmolLM2 was not trained for tools, so guided_choice makes it answer in hermes' format:
    the parser, not the model, is under test. Without the guide it answers in plain text."""
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": ' \
           '"celsius"}}\n</tool_call>'
    args = dict(model=hermes_model.name, messages=ASK, temperature=0, max_tokens=150,
                tools=TOOLS, extra_body={"guided_choice": [call]})
    reply = (await api.chat.completions.create(**args)).choices[0]
    assert reply.finish_reason == "tool_calls" and not reply.message.content
    [tool_call] = reply.message.tool_calls
    assert tool_call.function.name == "get_weather"
    assert json.loads(tool_call.function.arguments) == {"city": "Paris", "unit": "celsius"}
    chunks = [c async for c in await api.chat.completions.create(**args, stream=True)]
    streamed = [d for c in chunks for d in c.choices[0].delta.tool_calls or []]
    assert [(d.function.name, d.function.arguments) for d in streamed] == \
        [("get_weather", tool_call.function.arguments)]
    plain = (await api.chat.completions.create(
        model=hermes_model.name, messages=ASK, temperature=0, max_tokens=20, tools=TOOLS,
        tool_choice="auto")).choices[0]
    assert plain.message.tool_calls is None and plain.message.content
    assert plain.finish_reason in ("stop", "length")


async def test_grammars_and_schemas_that_never_end_are_400s_before_generating(stack) -> None:
    """Issue 24: `root ::= root` and a schema whose required property refers back to it were
    200s with garbage ('ectable', sampled from a row the grammar had all masked). Refused,
    naming the field sent; and a branch that cannot end, reached through a logit bias, fails
    the request with a 400 at that token rather than sampling from nothing."""
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    linked = {"$defs": {"node": {"type": "object", "properties": {
        "next": {"$ref": "#/$defs/node"}}, "required": ["next"]}}, "$ref": "#/$defs/node"}
    self_ref = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}
    bad = [
        ({"extra_body": {"guided_grammar": "root ::= root"}}, "guided_grammar"),
        ({"extra_body": {"guided_json": linked}}, "guided_json"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "loop", "schema": self_ref}}}, "response_format.json_schema.schema"),
        ({"extra_body": {"structured_outputs": {"grammar": 'root ::= "x" root'}}},
         "structured_outputs.grammar"),
    ]
    for fields, param in bad:
        with pytest.raises(openai.BadRequestError) as err:
            await api.chat.completions.create(model=model.name, messages=ASK, max_tokens=8,
                                              **fields)
        assert err.value.status_code == 400 and err.value.param == param, (fields, err.value)
        assert "no finite" in str(err.value), err.value
    async with httpx.AsyncClient(timeout=60) as http:
        tokenized = await http.post(f"{url}/tokenize", json={
            "model": model.name, "prompt": "x", "add_special_tokens": False})
    [x] = tokenized.json()["tokens"]
    with pytest.raises(openai.BadRequestError) as err:
        await api.completions.create(
            model=model.name, prompt="Say x:", max_tokens=8, temperature=0,
            logit_bias={str(x): 100},
            extra_body={"guided_grammar": 'root ::= "x" dead | "y"\ndead ::= dead'})
    assert err.value.param == "guided_grammar" and "allows no token" in str(err.value)
    async with httpx.AsyncClient(timeout=60) as http:  # streamed: an error event, named so too
        streamed = await http.post(f"{url}/v1/completions", json={
            "model": model.name, "prompt": "Say x:", "max_tokens": 8, "temperature": 0,
            "stream": True, "logit_bias": {str(x): 100},
            "guided_grammar": 'root ::= "x" dead | "y"\ndead ::= dead'})
    events = parse_sse(streamed.content)
    assert events[-1] == "[DONE]"
    [error] = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert error["param"] == "guided_grammar" and error["status"] == 400, error
    texts = [c["text"] for e in events[:-1] for c in json.loads(e).get("choices", [])]
    assert "".join(texts) == "x", texts  # what the grammar allowed, then the error: no garbage
    ok = await api.completions.create(model=model.name, prompt="Say x:", max_tokens=4,
                                      temperature=0, extra_body={"guided_choice": ["x", "y"]})
    assert ok.choices[0].text in ("x", "y")


async def test_a_tool_conversation_goes_on_after_the_tool_answers_openai_sdk(stack) -> None:
    """Issue 24: the agent loop. Turn 1 calls a tool (tool_choice "required" makes SmolLM2 call
    one); the client sends that assistant message back as the SDK gave it (content null, with
    its tool_calls) and a tool message with the result; turn 2 (tool_choice "auto", the hermes
    parser) answers. Turn 2 was a 400: "'dict object' has no attribute 'content'"."""
    settings, model, hermes_model, url, _ = stack
    api = async_api(url)
    messages: list = list(ASK)
    first = await api.chat.completions.create(
        model=hermes_model.name, messages=messages, temperature=0, max_tokens=120, tools=TOOLS,
        tool_choice="required")
    turn = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and turn.content is None
    messages.append(turn)  # the SDK's own message object, content None, as agents do
    for call in turn.tool_calls:
        check_arguments(call.function.name, call.function.arguments)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": json.dumps({"temperature": 21, "sky": "clear"})})
    second = await api.chat.completions.create(
        model=hermes_model.name, messages=messages, temperature=0, max_tokens=30, tools=TOOLS)
    answer = second.choices[0]
    assert answer.finish_reason in ("stop", "length", "tool_calls")
    assert answer.message.content or answer.message.tool_calls
    assert second.usage.prompt_tokens > first.usage.prompt_tokens  # the tool turns were read
    # content as a list of text parts, and an explicit null on the tool-call turn, by hand
    raw = [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
           {"role": "assistant", "content": None, "tool_calls": [
               {"id": "call_1", "type": "function", "function": {
                   "name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
           {"role": "tool", "tool_call_id": "call_1",
            "content": [{"type": "text", "text": "21 C, clear"}]}]
    third = await api.chat.completions.create(model=model.name, messages=raw, temperature=0,
                                              max_tokens=10, tools=TOOLS, tool_choice="none")
    assert third.choices[0].message.content


async def test_a_tool_conversation_goes_on_with_langchain_bind_tools(stack) -> None:
    """The same loop as LangChain runs it: ChatOpenAI(base_url=...).bind_tools(...), the
    AIMessage with tool_calls (which langchain-openai sends with content null) and a
    ToolMessage, then the model's answer."""
    from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
    from langchain_openai import ChatOpenAI

    settings, model, hermes_model, url, _ = stack
    chat = ChatOpenAI(base_url=f"{url}/v1", api_key="none", model=hermes_model.name,
                      temperature=0, max_tokens=120, max_retries=0, timeout=120)
    history: list = [HumanMessage("What is the weather in Paris right now?")]
    calling = chat.bind_tools(TOOLS, tool_choice="get_weather")
    ai = await calling.ainvoke(history)
    assert isinstance(ai, AIMessage) and len(ai.tool_calls) == 1, ai
    [call] = ai.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    check_arguments(call["name"], json.dumps(call["args"]))
    history += [ai, ToolMessage(content='{"temperature": 21, "sky": "clear"}',
                                tool_call_id=call["id"])]
    answer = await chat.bind_tools(TOOLS).ainvoke(history)
    assert isinstance(answer, AIMessage) and (answer.content or answer.tool_calls), answer
    assert answer.usage_metadata and answer.usage_metadata["input_tokens"] > \
        ai.usage_metadata["input_tokens"]


async def test_a_reasoning_parser_splits_the_models_real_answer(stack) -> None:
    """deepseek_r1 on SmolLM2's own answer (no </think> in it is the likely case: then it is all
    reasoning, as vLLM reads it): the chat answer, whole and streamed, splits exactly the text
    the same prompt gives through /v1/completions, and its usage counts the reasoning tokens."""
    from shoal.services.gateway.parsers.reasoning import reasoning_parser

    settings, model, hermes_model, url, r1_model = stack
    messages = [{"role": "user", "content": "What is 2 + 2? Think it through."}]
    async with httpx.AsyncClient(base_url=url, timeout=120) as http:
        ids = (await http.post("/tokenize", json={"model": r1_model.name,
                                                  "messages": messages})).json()["tokens"]
        off = (await http.post("/tokenize", json={
            "model": r1_model.name, "messages": messages,
            "chat_template_kwargs": {"enable_thinking": False}})).json()["tokens"]
        bad = await http.post("/v1/chat/completions", json={
            "model": r1_model.name, "messages": messages,
            "chat_template_kwargs": {"add_generation_prompt": False}})
    assert off[:len(ids)] == ids and len(off) > len(ids)  # the template read the variable
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    api = async_api(url)
    raw = (await api.completions.create(model=r1_model.name, prompt=ids, temperature=0,
                                        max_tokens=24)).choices[0].text
    parser = reasoning_parser("deepseek_r1")
    first, last = parser.feed(raw), parser.finish()
    expected = (first.reasoning + last.reasoning or None, first.content + last.content or None)
    assert (expected[0] or "") + (expected[1] or "") == raw.replace("<think>", "", 1).replace(
        "</think>", "", 1)
    whole = await api.chat.completions.create(model=r1_model.name, messages=messages,
                                              temperature=0, max_tokens=24)
    message = whole.choices[0].message
    assert (message.model_extra["reasoning_content"], message.content) == expected
    details = whole.usage.completion_tokens_details
    assert 0 < details.reasoning_tokens <= whole.usage.completion_tokens
    if "</think>" not in raw:
        assert details.reasoning_tokens == whole.usage.completion_tokens
    stream = await api.chat.completions.create(
        model=r1_model.name, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True})
    reasoning, content, usage = "", "", None
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            reasoning += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            content += choice.delta.content or ""
    assert (reasoning or None, content or None) == expected
    assert usage.completion_tokens_details.reasoning_tokens == details.reasoning_tokens
    plain = await api.chat.completions.create(model=model.name, messages=messages,
                                              temperature=0, max_tokens=8)
    assert "reasoning_content" not in (plain.choices[0].message.model_extra or {})
