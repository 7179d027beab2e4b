"""OpenAI's Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id}. Thin: the body
becomes a chat request after the stored conversation of `previous_response_id` (protocol.py),
which the chat path answers under the same keys, limits, usage, metrics and spans; answer.py
writes it as a Response. With `store` (the default) the Response and its conversation are kept
in Postgres through the registry, scoped to the key that made them, before the client hears
that it is done: a stored conversation outlives any gateway or registry restart.
"""

from __future__ import annotations

import contextlib
from typing import Any

from aiohttp import web

from shoal.services.gateway.auth.quota import API_KEY
from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.routes import chat_answer, run_answer
from shoal.services.gateway.openai.serve import Answer
from shoal.services.gateway.openai.streaming import SSE_HEADERS, after_first
from shoal.services.gateway.responses_api.answer import (
    Output, ResponseStream, new_item_id, response_id, response_object
)
from shoal.services.gateway.responses_api.protocol import ResponsesRequest
from shoal.services.gateway.state import STATE
from shoal.shared.errors import NotFound, ShoalError
from shoal.shared.schemas.registry import StoredResponse

routes = web.RouteTableDef()


def _key_id(request: web.Request) -> str | None:
    key = request.get(API_KEY)
    return key.key_id if key is not None else None


@routes.post("/v1/responses")
async def create_response(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = parse_body(await read_body(request), ResponsesRequest)
    body.model, lora = await st.names.resolve_lora(body.model)  # (as chat resolves it)
    history: list[dict[str, Any]] = []
    if body.previous_response_id is not None:
        try:
            previous = await st.registry.get_response(body.previous_response_id,
                                                      _key_id(request))
        except NotFound as exc:
            exc.param = "previous_response_id"
            raise
        history = previous.conversation
    chat = body.to_chat(history)
    turn = [*history, *body.turn_messages()]
    with st.admission.slot(1):
        answer, tokens = chat_answer(request, chat, lora)
        rid = response_id(answer.builder.id)

        async def store(done: dict[str, Any], output: Output) -> None:
            if body.store:
                await st.registry.put_response(StoredResponse(
                    id=rid, key_id=_key_id(request), model=done["model"],
                    previous_response_id=body.previous_response_id,
                    conversation=[*turn, output.assistant_message()], response=done))

        async def whole() -> web.Response:
            completion = await answer.result()
            message = completion.choices[0].message
            output = Output(text=message.content or "", reasoning=message.reasoning_content or "",
                            reasoning_tokens=answer.builder.choices[0].reasoning_tokens, calls=[
                {"id": new_item_id("fc"), "call_id": c.id, "name": c.function.name,
                 "arguments": c.function.arguments} for c in message.tool_calls or []])
            done = response_object(body, rid, completion.model, completion.created, output,
                                   completion.choices[0].finish_reason, answer.builder.usage)
            await store(done, output)
            return web.json_response(done)

        async def stream() -> web.StreamResponse:
            return await _stream(request, answer, ResponseStream(
                req=body, id=rid, model=answer.builder.model), store)

        return await run_answer(request, answer, body.stream, chat.spec()[1], tokens,
                                stream if body.stream else whole)


async def _stream(request: web.Request, answer: Answer, events: ResponseStream,
                  store: Any) -> web.StreamResponse:
    """Events as the engine's replies come; an error after the first is an error event."""
    async with contextlib.aclosing(answer.entries()) as replies:
        first = await anext(replies)  # raises before the response is prepared
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await response.write(events.start())
        try:
            async for entries in after_first(first, replies):
                await response.write(events.feed(entries))  # type: ignore[arg-type]
            state = answer.builder.choices[0]
            closing, done = events.finish(state.finish_reason, answer.builder.usage,
                                          state.reasoning_tokens)
            await response.write(closing)
            await store(done, events.output)
            await response.write(events.completed(done))
        except ShoalError as exc:
            await response.write(events.error(exc.message, exc.code or exc.type, exc.param))
        await response.write_eof()
        return response


@routes.get("/v1/responses/{id}")
async def get_response(request: web.Request) -> web.Response:
    st = request.app[STATE]
    stored = await st.registry.get_response(request.match_info["id"], _key_id(request))
    await st.quota.admit(request, stored.model)  # a request under the key's limits; no usage
    return web.json_response(stored.response)


@routes.delete("/v1/responses/{id}")
async def delete_response(request: web.Request) -> web.Response:
    st = request.app[STATE]
    deleted = await st.registry.delete_response(request.match_info["id"], _key_id(request))
    return web.json_response({"id": deleted.id, "object": "response", "deleted": True})

