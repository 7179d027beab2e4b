"""A requester that vanishes mid-stream (issue 32, item 5), seen by a backend's adapter (the
same intake as our engine's): real NATS, the real registry, the adapter in this process, and a
stand-in vLLM server that streams one token every few milliseconds until its client leaves.

A requester whose NATS connection closes without an abort (a SIGKILLed gateway) gets its stream
stopped (the backend's HTTP stream closes) and its delivered tokens recorded by the adapter, once;
one that aborts first (a live gateway whose client left) gets it stopped and records it itself.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import aiohttp
import nats
import pytest
from aiohttp import web

from shoal.services.backends.proxy import BackendHandlers
from shoal.services.engine import InputProcessor
from shoal.shared.embedded import free_port
from shoal.shared.schemas.infer import (
    AbortRequest, GenerateRequest, InferChunk, InferReplyEnvelope, InferRequestEnvelope,
    UsageTag
)
from shoal.shared.schemas.registry import ApiKeyCreate, ApiKeyScope, UsageQuery
from tests.unit.test_backend_proxy import Tokenizer

pytestmark = pytest.mark.integration


@pytest.fixture
async def adapter(bus):
    closed: list[asyncio.Event] = []

    async def completions(request: web.Request) -> web.StreamResponse:  # vLLM's, endless
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        gone = asyncio.Event()
        closed.append(gone)
        try:
            for _ in range(5000):
                event = {"choices": [{"index": 0, "text": "a", "token_ids": [5]}]}
                await response.write(f"data: {json.dumps(event)}\n\n".encode())
                await asyncio.sleep(0.005)
        finally:
            gone.set()  # the adapter closed the stream (or it ran out)
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port(None)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    handlers = BackendHandlers(bus=bus, instance_id=uuid.uuid4().hex[:12], model_name="m",
                               base_url=f"http://127.0.0.1:{port}", served_name="m",
                               tokenizer=Tokenizer(), max_model_len=64)
    handlers.inputs = InputProcessor(tokenizer=handlers.tokenizer, max_model_len=64)
    handlers.session = aiohttp.ClientSession()
    await super(BackendHandlers, handlers).start()  # the intake, not the backend's prep
    try:
        yield handlers, closed
    finally:
        await handlers.stop_intake()
        await handlers.wait_in_flight(5)
        await handlers.close()
        await runner.cleanup()


async def stream_then_leave(handlers: BackendHandlers, settings, key_id: str,
                            abort_first: bool) -> int:
    """As a gateway: ask for a stream on a connection of its own, read some replies, then drop
    the connection (after an abort, as a live gateway does, or without: a SIGKILL). The tokens
    received."""
    nc = await nats.connect(settings.nats_url)
    inbox, received = nc.new_inbox(), []
    sub = await nc.subscribe(inbox)
    req = GenerateRequest(request_id=uuid.uuid4().hex, model="m", prompt="hi",
                          usage=UsageTag(key_id=key_id, model="m", record_id=uuid.uuid4().hex))
    await nc.publish(handlers.bus.subjects.infer(handlers.instance_id),
                     InferRequestEnvelope(request=req).model_dump_json().encode(), reply=inbox)
    while len(received) < 20:
        received.append(InferReplyEnvelope.model_validate_json((await sub.next_msg(5)).data).reply)
    if abort_first:
        await nc.publish(handlers.bus.subjects.abort(handlers.instance_id),
                         AbortRequest(request_id=req.request_id).model_dump_json().encode())
    await nc.close()  # the server drops its subscriptions, as for a killed process
    return sum(len(c.token_ids) for r in received if isinstance(r, InferChunk) for c in r.choices)


async def usage(client, key_id: str) -> tuple[int, int, int]:
    rows = (await client.usage(UsageQuery(key_id=key_id))).rows
    return (sum(r.requests for r in rows), sum(r.prompt_tokens for r in rows),
            sum(r.output_tokens for r in rows))


async def test_a_vanished_requester_is_stopped_and_its_usage_recorded_once(
        adapter, settings, client) -> None:
    handlers, closed = adapter
    key = await client.create_key(ApiKeyCreate(name=f"gone-{uuid.uuid4().hex[:6]}",
                                               scope=ApiKeyScope.INFERENCE))
    received = await stream_then_leave(handlers, settings, key.id, abort_first=False)
    await asyncio.wait_for(closed[0].wait(), 5)  # the backend's stream closed: work stopped
    assert not handlers.tasks and handlers.requesters is not None
    assert handlers.requesters.abandoned == 1
    for _ in range(100):
        if (got := await usage(client, key.id))[0]:
            break
        await asyncio.sleep(0.05)
    requests, prompt, output = got
    # the replies published before the first one the requester missed: at least those it read
    assert (requests, prompt) == (1, 1) and received <= output < received + 50, (got, received)
    await asyncio.sleep(2)
    assert await usage(client, key.id) == got  # once


async def test_a_requester_that_aborts_first_records_it_itself(adapter, settings,
                                                               client) -> None:
    handlers, closed = adapter
    key = await client.create_key(ApiKeyCreate(name=f"left-{uuid.uuid4().hex[:6]}",
                                               scope=ApiKeyScope.INFERENCE))
    await stream_then_leave(handlers, settings, key.id, abort_first=True)
    await asyncio.wait_for(closed[0].wait(), 5)
    await asyncio.sleep(2)  # past the adapter's grace
    assert (await client.usage(UsageQuery(key_id=key.id))).rows == []
