"""A real worker runs a real engine process for SmolLM2 and serves it over NATS: streamed
replies with seq numbers and usage, the model's queue group, tokenize, refusals, aborts that
free the engine, a killed engine coming back RUNNING, and a deleted instance stopping it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid

import psutil
import pytest

from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.infer import (
    AbortRequest, ChatMessage, EngineLoad, GenerateRequest, InferChunk, InferEnd, InferError,
    InferReplyEnvelope,
    InferRequestEnvelope, SamplingOptions, TokenizeReply, TokenizeRequest,
)
from shoal.shared.schemas.registry import (
    DeleteRequest, InstanceCreate, InstanceTransition, ModelCreate, Placement,
)
from shoal.shared.states import InstanceState
from tests.integration.conftest import make_settings, running_services

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
READY_TIMEOUT = 300


async def wait_state(client: RegistryClient, instance_id: str, state: InstanceState,
                     timeout: float):
    deadline = time.monotonic() + timeout
    inst = None
    while time.monotonic() < deadline:
        inst = await client.get_instance(instance_id)
        if inst.state is state:
            return inst
        await asyncio.sleep(0.5)
    raise AssertionError(f"instance not {state.value} after {timeout}s: {inst}")


async def generate(bus: Bus, subject: str, req: GenerateRequest, abort_after: int | None = None,
                   instance_id: str | None = None) -> list:
    replies = []
    async for msg in bus.stream_replies(subject, InferRequestEnvelope(request=req)):
        reply = InferReplyEnvelope.model_validate_json(msg.data).reply
        assert reply.seq == len(replies), "replies must arrive in seq order without gaps"
        replies.append(reply)
        if abort_after is not None and len(replies) == abort_after:
            await bus.publish(bus.subjects.abort(instance_id),
                              AbortRequest(request_id=req.request_id))
        if isinstance(reply, (InferEnd, InferError)):
            return replies
    raise AssertionError("stream ended without an end message")


def text_of(replies: list) -> str:
    return "".join(c.text for r in replies if isinstance(r, InferChunk) for c in r.choices)


async def latest_load(bus: Bus, instance_id: str) -> EngineLoad:
    future: asyncio.Future[EngineLoad] = asyncio.get_running_loop().create_future()

    async def on_load(msg) -> None:
        if not future.done():
            future.set_result(EngineLoad.model_validate_json(msg.data))

    sub = await bus.nc.subscribe(bus.subjects.load(instance_id), cb=on_load)
    try:
        return await asyncio.wait_for(future, 5)
    finally:
        await sub.unsubscribe()


@pytest.fixture(scope="module")
async def stack(servers, tmp_path_factory):
    settings = make_settings(servers, tmp_path_factory.mktemp("engine-e2e"), drain_timeout=5.0,
                             engine_restart_max_backoff=2.0)
    worker_name = f"real-{uuid.uuid4().hex[:6]}"
    async with running_services(settings, scheduler=False, worker={"worker_name": worker_name},
                                name="engine-e2e") as stack:
        bus, client = stack.bus, stack.client
        worker = next(w for w in await client.list_workers() if w.name == worker_name)
        model = await client.create_model(ModelCreate(
            name=f"smol-{uuid.uuid4().hex[:6]}", source=str(smollm2_gguf_path()), device="cpu",
            max_model_len=512, engine_args={"max_num_seqs": 8, "kv_cache_memory": 64 * 2**20}))
        inst = await client.create_instance(InstanceCreate(model_id=model.id))
        inst = await client.transition_instance(InstanceTransition(
            id=inst.id, version=inst.version, state=InstanceState.SCHEDULED,
            placement=Placement(worker_id=worker.id)))
        inst = await wait_state(client, inst.id, InstanceState.RUNNING, READY_TIMEOUT)
        yield bus, client, model, inst


def engine_pids(instance_id: str) -> list[int]:
    cmdlines = {p.pid: " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"])}
    return [pid for pid, cmd in cmdlines.items() if instance_id in cmd and "engine" in cmd]


async def test_chat_streams_with_seq_and_usage(stack) -> None:
    bus, client, model, inst = stack
    req = GenerateRequest(request_id=uuid.uuid4().hex, model=model.name,
                          messages=[ChatMessage(role="user",
                                                content="What is the capital of France?")],
                          sampling=SamplingOptions(temperature=0, max_tokens=20))
    replies = await generate(bus, bus.subjects.infer(inst.id), req)
    assert isinstance(replies[0], InferChunk)
    assert replies[0].choices == [] and replies[0].prompt_token_ids
    end = replies[-1]
    assert isinstance(end, InferEnd), end
    assert "Paris" in text_of(replies)
    assert end.usage.prompt_tokens == len(replies[0].prompt_token_ids)
    assert end.usage.completion_tokens == sum(len(c.token_ids) for r in replies[1:-1]
                                              for c in r.choices)
    assert end.finish_reasons[0] in ("stop", "length") and end.instance_id == inst.id


async def test_plain_prompt_and_tokenize(stack) -> None:
    bus, client, model, inst = stack
    req = GenerateRequest(request_id=uuid.uuid4().hex, model=model.name,
                          prompt="The capital of France is",
                          sampling=SamplingOptions(temperature=0, max_tokens=5))
    replies = await generate(bus, bus.subjects.infer(inst.id), req)
    assert isinstance(replies[-1], InferEnd) and text_of(replies).strip()
    tok = await bus.request(bus.subjects.infer(inst.id), InferRequestEnvelope(
        request=TokenizeRequest(model=model.name, prompt="Hello world")), TokenizeReply)
    assert tok.count == len(tok.tokens) > 0 and tok.max_model_len == 512


async def test_bad_requests_are_refused_before_acceptance(stack) -> None:
    bus, client, model, inst = stack
    too_long = GenerateRequest(request_id=uuid.uuid4().hex, model=model.name, prompt="hello " * 600,
                               sampling=SamplingOptions(max_tokens=10))
    replies = await generate(bus, bus.subjects.infer(inst.id), too_long)
    assert len(replies) == 1 and isinstance(replies[0], InferError) and replies[0].status == 400
    bad = GenerateRequest(request_id=uuid.uuid4().hex, model=model.name, prompt="hi",
                          sampling=SamplingOptions(temperature=-1))
    replies = await generate(bus, bus.subjects.infer(inst.id), bad)
    assert isinstance(replies[0], InferError) and replies[0].error.param == "temperature"
    with pytest.raises(InvalidRequest):
        await bus.request(bus.subjects.infer(inst.id), InferRequestEnvelope(
            request=TokenizeRequest(model=model.name)), TokenizeReply)


async def test_abort_frees_the_engine(stack) -> None:
    bus, client, model, inst = stack
    req = GenerateRequest(request_id=uuid.uuid4().hex, model=model.name,
                          prompt="Count to one thousand:",
                          sampling=SamplingOptions(temperature=0, max_tokens=400, ignore_eos=True))
    replies = await generate(bus, bus.subjects.infer(inst.id), req, abort_after=3,
                             instance_id=inst.id)
    assert isinstance(replies[-1], InferError) and replies[-1].status == 499
    deadline = time.monotonic() + 5
    while (load := await latest_load(bus, inst.id)).num_running and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    assert load.num_running == 0 and load.num_waiting == 0 and load.kv_cache_usage == 0.0


async def test_killed_engine_comes_back_then_delete_stops_it(stack) -> None:
    bus, client, model, inst = stack
    pids = engine_pids(inst.id)
    assert len(pids) == 1
    os.kill(pids[0], signal.SIGKILL)
    errored = await wait_state(client, inst.id, InstanceState.ERROR, 30)
    assert "exited with -9" in (errored.state_message or "") and errored.restart_count >= 1
    back = await wait_state(client, inst.id, InstanceState.RUNNING, READY_TIMEOUT)
    new_pids = engine_pids(inst.id)
    assert new_pids and new_pids != pids
    await client.delete_instance(DeleteRequest(id=back.id))
    deadline = time.monotonic() + 30
    while engine_pids(inst.id) and time.monotonic() < deadline:
        await asyncio.sleep(0.3)
    assert not engine_pids(inst.id)
