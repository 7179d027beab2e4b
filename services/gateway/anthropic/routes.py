"""Anthropic's Messages API: POST /v1/messages and /v1/messages/count_tokens. Thin: the body
becomes a chat request (protocol.py), which the chat path answers under the same keys, limits,
usage, metrics and spans; answer.py writes it in Anthropic's shape. Errors on these routes are
Anthropic-shaped (errors.py asks `is_anthropic`).
"""

from __future__ import annotations

import contextlib

from aiohttp import web

from shoal.services.gateway.anthropic.answer import (
    MessageStream, error_body, message, message_id, sse
)
from shoal.services.gateway.anthropic.objects import MessageTokensCount
from shoal.services.gateway.anthropic.protocol import CountTokensRequest, MessagesRequest
from shoal.services.gateway.errors import ANTHROPIC_PREFIX, read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.routes import chat_answer, run_answer
from shoal.services.gateway.openai.serve import Answer
from shoal.services.gateway.openai.streaming import SSE_HEADERS, after_first
from shoal.services.gateway.state import STATE
from shoal.shared.errors import ShoalError
from shoal.shared.schemas.infer import TokenizeReply, TokenizeRequest

routes = web.RouteTableDef()
PREFIX = ANTHROPIC_PREFIX


@routes.post(PREFIX)
async def create_message(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = parse_body(await read_body(request), MessagesRequest)
    body.model, lora = await st.names.resolve_lora(body.model)  # (as chat resolves it)
    chat = body.to_chat()
    with st.admission.slot(1):
        answer, tokens = chat_answer(request, chat, lora)
        state = answer.builder.choices

        async def whole() -> web.Response:
            completion = await answer.result()
            return web.json_response(message(completion, state[0].stop_reason,
                                             answer.builder.usage).body())

        async def stream() -> web.StreamResponse:
            return await _stream(request, answer)

        return await run_answer(request, answer, body.stream, chat.spec()[1], tokens,
                                stream if body.stream else whole)


async def _stream(request: web.Request, answer: Answer) -> web.StreamResponse:
    """Events as the engine's replies come; an error after the first is an `error` event."""
    builder = answer.builder
    events = MessageStream(id=message_id(builder.id), model=builder.model)
    async with contextlib.aclosing(answer.entries()) as replies:
        first = await anext(replies)  # raises before the response is prepared
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        await response.write(events.start(answer.prompt_tokens.get(0, 0)))
        try:
            async for entries in after_first(first, replies):
                await response.write(events.feed(entries))
            state = builder.choices[0]
            await response.write(events.finish(state.finish_reason, state.stop_reason,
                                               builder.usage))
        except ShoalError as exc:
            await response.write(sse(error_body(exc.http_status, exc.message)))
        await response.write_eof()
        return response


@routes.post(PREFIX + "/count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens as the model's chat template renders it (system, turns, tools)."""
    st = request.app[STATE]
    body = parse_body(await read_body(request), CountTokensRequest)
    body.model, _ = await st.names.resolve_lora(body.model)  # an adapter: its base's tokenizer
    await st.quota.admit(request, body.model)  # a request under the key's limits; no usage
    chat = body.to_chat()
    req = TokenizeRequest(model=body.model, messages=chat.wire_messages(),
                          add_generation_prompt=True,
                          tools=[t.wire() for t in chat.tools] if chat.tools else None)
    reply = await st.client.call(body.model, req, TokenizeReply,
                                 st.settings.gateway_accept_timeout)
    return web.json_response(MessageTokensCount(input_tokens=reply.count).body())

