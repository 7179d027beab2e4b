"""What the NATS adapter of every engine instance shares, generation (handlers.py) or embeddings
(embed_handlers.py): its requests arrive on shoal.infer.<id> until it drains, and its load goes
out on shoal.load.<id> every LOAD_INTERVAL_S (draining included), so the gateway's instance table
and router treat both kinds alike. Subclasses answer the requests and say their load."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from opentelemetry.trace import Span
from nats.errors import MaxPayloadError

from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import decode, encode, too_large
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.loops import run_every
from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.server.heap import trim_after
from shoal.services.engine.server.requesters import Requesters
from shoal.services.engine.server.tracing import generate_span
from shoal.shared.schemas.common import ErrorBody
from shoal.shared.schemas.infer import (
    AbortRequest, DetokenizeReply, DetokenizeRequest, EmbedRequest, EngineLoad, GenerateRequest,
    InferChunk, InferEnd, InferError, InferReplyEnvelope, InferRequestEnvelope, TokenizeReply,
    ScoreRequest, TokenizeRequest, Usage
)

log = logging.getLogger(__name__)
LOAD_INTERVAL_S = 0.25


@dataclass
class Intake:
    bus: Bus
    instance_id: str
    model_name: str
    subs: list[Subscription] = field(default_factory=list)
    draining: bool = False

    async def start(self) -> None:
        """Take requests (and whatever else `subscribe_more` adds), flushed: once this returns
        the server routes them here."""
        nc = self.bus.nc
        # a queue group: should a fenced engine (its worker back from a partition, the instance
        # placed anew) still listen for a moment beside its successor, one of them answers
        self.subs = [await nc.subscribe(self.bus.subjects.infer(self.instance_id),
                                        queue=self.bus.subjects.infer(self.instance_id),
                                        cb=self.on_request)]
        await self.subscribe_more()
        await nc.flush()

    async def subscribe_more(self) -> None:
        """Subjects besides the requests' (kept while draining)."""

    async def on_request(self, msg: Msg) -> None:
        raise NotImplementedError

    async def stop_intake(self) -> None:
        """Drain step 1: no new requests reach this engine (in-flight ones go on); the load says
        it drains, so gateways stop routing here at once."""
        self.draining = True
        for sub in self.subs:
            await sub.unsubscribe()
        self.subs = []
        await self.publish_load()

    async def wait_in_flight(self, timeout: float) -> None:
        """Drain step 2: let the requests in flight finish (up to `timeout`)."""
        raise NotImplementedError

    def load(self) -> EngineLoad:
        raise NotImplementedError

    async def publish_load(self) -> None:
        await self.bus.publish(self.bus.subjects.load(self.instance_id), self.load())

    async def publish_load_forever(self, stop: asyncio.Event) -> None:
        await run_every(LOAD_INTERVAL_S, stop, self.publish_load, "publishing load", log,
                        expected=())


class Replies:
    """One generate request's replies on its inbox, numbered from 0 (the accepting chunk): every
    reply counts, so a gap is visible to the gateway. An answer too large for the NATS server
    raises a 413 (too_large), which the caller sends as a small error reply, never a hang.
    With `status_to` set, each reply goes out with the reply subject `<status_to>.<seq>`, where
    NATS says "no responders" once the requester's inbox is gone (requesters.py); the tokens of
    each reply are kept, to say what was delivered before the one it lost."""

    def __init__(self, nc: NATS, inbox: str, request_id: str) -> None:
        self.nc, self.inbox, self.request_id = nc, inbox, request_id
        self.seq = 0
        self.status_to: str | None = None
        self.sent_tokens: list[int] = []
        self.prompt_tokens = self.cached_tokens = 0

    async def chunk(self, **fields: Any) -> None:
        reply = InferChunk(request_id=self.request_id, seq=self.seq, **fields)
        if reply.prompt_token_ids is not None:
            self.prompt_tokens = len(reply.prompt_token_ids)
        await self._send(reply, sum(len(c.token_ids) for c in reply.choices))

    async def end(self, **fields: Any) -> None:
        await self._send(InferEnd(request_id=self.request_id, seq=self.seq, **fields))

    async def error(self, exc: ShoalError, status: int) -> None:
        await self._send(InferError(request_id=self.request_id, seq=self.seq,
                                    error=ErrorBody(**exc.to_dict()), status=status))

    async def _send(self, reply: InferChunk | InferEnd | InferError, tokens: int = 0) -> None:
        data = encode(InferReplyEnvelope(reply=reply))
        try:
            if self.status_to is None:
                await self.nc.publish(self.inbox, data)
            else:
                await self.nc.publish(self.inbox, data, reply=f"{self.status_to}.{self.seq}")
        except MaxPayloadError:
            raise too_large(self.nc, data, "the answer") from None
        self.sent_tokens.append(tokens)
        self.seq += 1

    def delivered(self, lost_seq: int) -> Usage:
        """The usage of the replies before `lost_seq` (the prompt counts once seq 0 arrived)."""
        return Usage(prompt_tokens=self.prompt_tokens if lost_seq > 0 else 0,
                     completion_tokens=sum(self.sent_tokens[:lost_seq]),
                     cached_tokens=self.cached_tokens if lost_seq > 0 else 0)


@dataclass(kw_only=True)
class StreamIntake(Intake):
    """An intake whose generate requests each run as a task (our engine's handlers.py, a
    backend's adapter): an abort cancels the request's task, draining waits for the tasks.
    /tokenize and /detokenize are answered on the `lookups` thread, each in a task of its own:
    off the event loop (issue 24: a large /tokenize kept the engine from publishing its load for
    seconds, so gateways routed around it). Subclasses say how to tokenize and detokenize."""

    tasks: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    inputs: InputProcessor | None = None
    """Prompts as token ids (set at start, over this adapter's own tokenizer)."""
    lookups: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="tokenize-api"))
    lookup_tasks: set[asyncio.Task[None]] = field(default_factory=set)
    requesters: Requesters | None = None
    """Stops the requests whose requester vanished (requesters.py); set at start."""

    async def on_request(self, msg: Msg) -> None:
        try:
            request = decode(msg.data, InferRequestEnvelope).request
        except InvalidRequest as exc:
            await self.bus.respond_error(msg, exc)
            return
        if isinstance(request, GenerateRequest):
            self.start_generate(request, msg)  # an abort cancels its task: the stream closes
            return
        if isinstance(request, EmbedRequest | ScoreRequest):
            what = ("embeddings need an embedding model" if isinstance(request, EmbedRequest)
                    else "scores and reranking need a cross-encoder")
            await self.bus.respond_error(msg, InvalidRequest(
                f"model {self.model_name} generates text; {what}", param="model",
                code="wrong_model_type"))
            return
        task = asyncio.create_task(self.look_up(request, msg))  # the next message is not held
        self.lookup_tasks.add(task)
        task.add_done_callback(self.lookup_tasks.discard)

    async def look_up(self, request: TokenizeRequest | DetokenizeRequest, msg: Msg) -> None:
        """Answer a /tokenize or /detokenize on the `lookups` thread."""
        work = self.tokenize if isinstance(request, TokenizeRequest) else self.detokenize
        try:
            reply = await asyncio.get_running_loop().run_in_executor(self.lookups, work,
                                                                     request)
        except ShoalError as exc:
            await self.bus.respond_error(msg, exc)
            return
        data = encode(reply)
        try:
            await msg.respond(data)
        except MaxPayloadError:  # e.g. the token ids of a huge prompt
            await self.bus.respond_error(msg, too_large(self.bus.nc, data, "the answer"))

    def tokenize(self, req: TokenizeRequest) -> TokenizeReply:
        raise NotImplementedError

    def detokenize(self, req: DetokenizeRequest) -> DetokenizeReply:
        raise NotImplementedError

    async def subscribe_more(self) -> None:
        # Aborts stay subscribed while draining: in-flight requests may still be cancelled.
        self.requesters = Requesters(self.bus)
        await self.requesters.start()
        await self.bus.nc.subscribe(self.bus.subjects.abort(self.instance_id), cb=self.on_abort)

    async def generate(self, req: GenerateRequest, inbox: str,
                       headers: dict[str, str] | None = None) -> None:
        """Serve one request inside its span, in the trace its NATS headers carry."""
        subject = self.bus.subjects.infer(self.instance_id)
        replies = Replies(self.bus.nc, inbox, req.request_id)
        with generate_span(req, headers, subject, self.instance_id) as span, (
                self.requesters.watching(req, replies) if self.requesters is not None
                else contextlib.nullcontext()):
            await self.serve(req, replies, span)

    async def serve(self, req: GenerateRequest, replies: Replies, span: Span) -> None:
        """Answer `req` on `replies`: a first chunk with the prompt's token ids, the deltas,
        then an end or an error."""
        raise NotImplementedError

    def check_tool_call_parser(self, req: GenerateRequest, parser: str | None) -> str | None:
        """The parser the gateway applies to an "auto" tool choice answer (vLLM refuses "auto"
        without --tool-call-parser; so do we), given the one this model was served with."""
        if not req.needs_tool_call_parser:
            return None
        if parser is None:
            raise InvalidRequest(  # vLLM's words first: clients' docs and checks know them
                f'"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser '
                f'to be set: model {self.model_name} was served without a tool call parser '
                f'(`shoal serve MODEL --enable-auto-tool-choice --tool-call-parser hermes`, or '
                f'`shoal models deploy ... --engine-arg tool_call_parser=hermes`); tools '
                f'without tool_choice mean "auto": send "none", "required" or a named '
                f'function instead', param="tool_choice")
        return parser

    @staticmethod
    def reasoning_parser_for(req: GenerateRequest, parser: str | None) -> str | None:
        """The reasoning parser the gateway applies: chat answers only (vLLM's rule)."""
        return parser if req.messages is not None else None

    def start_generate(self, request: GenerateRequest, msg: Msg) -> None:
        """Serve `request` in a task of its own, known by its id until it ends."""
        if not msg.reply:
            return
        task = asyncio.create_task(self.generate(request, msg.reply, msg.headers),
                                   name=request.request_id)
        self.tasks[request.request_id] = task
        task.add_done_callback(lambda _t, rid=request.request_id: self.tasks.pop(rid, None))

    async def on_abort(self, msg: Msg) -> None:
        try:
            request_id = decode(msg.data, AbortRequest).request_id
        except InvalidRequest:
            return
        if self.requesters is not None:
            self.requesters.aborted(request_id)  # its gateway is alive and records its usage
        task = self.tasks.get(request_id)
        if task is not None:
            task.cancel()  # the request's own cleanup aborts it where it runs

    async def wait_in_flight(self, timeout: float) -> None:
        """Drain step 2: let running requests (and lookups) finish, then abort what is left."""
        if self.lookup_tasks:
            await asyncio.wait(list(self.lookup_tasks), timeout=timeout)
        pending = [t for t in self.tasks.values() if not t.done()]
        if pending:
            _, late = await asyncio.wait(pending, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        if self.requesters is not None:
            await self.requesters.drain(timeout)

    def prompt_token_ids(self, req: GenerateRequest | TokenizeRequest,
                         inputs: InputProcessor | None = None) -> list[int]:
        """The request's prompt as token ids (the input processor's rules), by `inputs` (the
        adapter's own when None); after a large one, the heap the tokenizer freed goes back to
        the OS (heap.py)."""
        inputs = inputs or self.inputs
        assert inputs is not None, "start() sets the input processor"
        messages = ([m.model_dump(exclude_none=True) for m in req.messages]
                    if req.messages is not None else None)
        size = sum(len(t.encode()) for t in [req.prompt or ""] + [
            m.content or "" for m in req.messages or []])
        try:
            return self._token_ids(req, inputs, messages)
        finally:
            trim_after(size)

    def _token_ids(self, req: GenerateRequest | TokenizeRequest, inputs: InputProcessor,
                   messages: list[dict[str, Any]] | None) -> list[int]:
        return inputs.request_ids(
            prompt=req.prompt, messages=messages,
            prompt_token_ids=req.prompt_token_ids if isinstance(req, GenerateRequest) else None,
            tools=[t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None,
            add_generation_prompt=req.add_generation_prompt,
            add_special_tokens=getattr(req, "add_special_tokens", True),
            chat_template_kwargs=req.chat_template_kwargs)
