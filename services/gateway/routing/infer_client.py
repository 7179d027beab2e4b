"""Talking to engines: send a generate request, stream its replies with a seq check, retry a
request that has not started on another instance, fail a stream whose engine died, and abort the
engine's request when the client goes away. Tokenize / detokenize are plain requests.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from nats.aio.msg import Msg
from pydantic import BaseModel, ValidationError

from shoal.services.gateway.routing.failover import Failover
from shoal.services.gateway.routing.instances import EngineGone, InstanceTable, LiveInstance
from shoal.services.gateway.routing.router import Router
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.errors import NotFound, ShoalError, Timeout, Unavailable
from shoal.shared.schemas.infer import (
    AbortRequest, GenerateRequest, InferChunk, InferEnd, InferError, InferReplyEnvelope,
    InferRequestEnvelope
)
from shoal.shared.schemas.scheduler import ScaleDemand

log = logging.getLogger(__name__)
R = TypeVar("R", bound=BaseModel)
COLD_START_POLL_S = 0.2
COLD_START_DEMAND_EVERY_S = 2.0
NO_RESPONDERS = "503"


class _NotStarted(Exception):
    """The attempt failed before the engine accepted the request: another instance may try."""

    def __init__(self, error: ShoalError) -> None:
        super().__init__(error.message)
        self.error = error


class InferClient:
    def __init__(self, bus: Bus, registry: RegistryClient, table: InstanceTable, router: Router,
                 settings: Settings,
                 on_failover: Callable[[str, str], None] = lambda model, outcome: None) -> None:
        self.on_failover = on_failover
        """(model, outcome): a stream's engine died; "resumed" elsewhere, or why not."""
        self.bus = bus
        self.registry = registry
        self.table = table
        self.router = router
        self.settings = settings

    async def no_instance(self, model: str) -> ShoalError:
        """404 for a model the registry does not know, else 503 (nothing RUNNING serves it)."""
        try:
            await self.registry.get_model(name=model)
        except NotFound:
            return NotFound(f"The model `{model}` does not exist.", param="model",
                            code="model_not_found")
        return Unavailable(f"no running instance serves model `{model}` now; retry later",
                           param="model")

    def _pick(self, model: str, hashes: Sequence[bytes], tried: list[str]) -> str | None:
        return self.router.choose(self.table.candidates(model), hashes, exclude=tried)

    async def _first_pick(self, model: str, hashes: Sequence[bytes]) -> str | None:
        """An instance for a new request. With none in the table, the registry is asked for the
        model's RUNNING instances (one may be RUNNING there before its event arrives here); for
        an autoscaled model with none running (scaled to zero, or its first instance still
        starting), ask the scheduler for one and wait for it up to
        `gateway_cold_start_timeout`, then 503."""
        instance_id = self._pick(model, hashes, [])
        if instance_id is not None:
            return instance_id
        try:
            record = await self.registry.get_model(name=model)
        except NotFound:
            return None  # 404 from no_instance()
        await self.table.catch_up(record.id)
        instance_id = self._pick(model, hashes, [])
        if instance_id is not None or record.autoscaling is None:
            return instance_id
        timeout = self.settings.gateway_cold_start_timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        next_demand = 0.0
        while loop.time() < deadline:
            if loop.time() >= next_demand:
                await self.bus.publish(self.bus.subjects.autoscale_demand, ScaleDemand(model=model))
                next_demand = loop.time() + COLD_START_DEMAND_EVERY_S
            await asyncio.sleep(COLD_START_POLL_S)
            instance_id = self._pick(model, hashes, [])
            if instance_id is not None:
                return instance_id
        raise Unavailable(f"model `{model}` has no running instance (scaled to zero) and none "
                          f"started within {timeout:g} s; retry later", param="model",
                          code="cold_start_timeout")

    async def generate(self, req: GenerateRequest,
                       hashes: Sequence[bytes] = ()) -> AsyncIterator[InferChunk | InferEnd]:
        """Yield the engine's chunks (seq 0 first) and its end; raise a ShoalError on failure.
        A request not started moves to another instance; a started one whose engine died goes
        on on another replica where it can (failover.py), counted by `on_failover`."""
        tried: list[str] = []
        last: ShoalError | None = None
        failover, attempt, moving = Failover(req), req, False
        for _ in range(max(1, self.settings.gateway_max_attempts)):
            instance_id = (self._pick(req.model, hashes, tried) if tried
                           else await self._first_pick(req.model, hashes))
            if instance_id is None:
                break
            tried.append(instance_id)
            try:
                async for reply in self._attempt(instance_id, attempt, hashes):
                    seen = failover.seen(reply)
                    if moving:
                        moving = False
                        self.on_failover(req.model, "resumed")
                    if seen is not None:
                        yield seen
                return
            except _NotStarted as exc:
                log.warning("request %s not started on %s (%s); trying another instance",
                            req.request_id, instance_id, exc.error.message)
                last = exc.error
            except ShoalError as exc:
                if exc.http_status != 503:
                    raise
                why = failover.refusal()
                if why is not None:
                    self.on_failover(req.model, why)
                    raise
                log.warning("the engine of %s failed mid-stream (%s); request %s goes on on "
                            "another replica", instance_id, exc.message, req.request_id)
                attempt, last, moving = failover.resumed(), exc, True
        if moving:
            self.on_failover(req.model, "no_replica")
        if last is not None:
            raise last
        raise await self.no_instance(req.model)

    async def _attempt(self, instance_id: str, req: GenerateRequest,
                       hashes: Sequence[bytes]) -> AsyncIterator[InferChunk | InferEnd]:
        queue: asyncio.Queue[object] = asyncio.Queue()
        inst = self.table.watch(instance_id, queue)
        if inst is None:
            raise _NotStarted(Unavailable(f"instance {instance_id} left the table"))
        started = finished = False
        try:
            async with self.bus.streamed_request(
                    self.bus.subjects.infer(instance_id), InferRequestEnvelope(request=req),
                    headers={"request_id": req.request_id}, queue=queue):
                try:
                    expected = 0
                    while True:
                        timeout = (self.settings.gateway_stream_idle_timeout if started
                                   else self.settings.gateway_accept_timeout)
                        reply = self._decode(await self._next(queue, timeout, started, inst))
                        self.table.heard(inst)  # a reply is a sign of life, as a load is
                        if isinstance(reply, InferError):
                            finished = True
                            error = ShoalError.from_dict(reply.error.model_dump(),
                                                         status=reply.status)
                            if not started and reply.status in (503, 429):
                                raise _NotStarted(error)
                            raise error
                        if reply.seq != expected:
                            raise Unavailable(f"stream of request {req.request_id} lost "
                                              f"messages (expected seq {expected}, got "
                                              f"{reply.seq})")
                        expected += 1
                        if not started:
                            started = True
                            self.router.record(hashes, instance_id)
                        finished = isinstance(reply, InferEnd)
                        yield reply
                        if finished:
                            return
                finally:
                    # Also when it timed out before acceptance: it may still start there. Sent
                    # before the inbox is dropped, so the engine hears that this gateway is alive
                    # and records the usage itself (engine server/requesters.py).
                    if not finished:
                        finished = True
                        await self._abort(instance_id, req.request_id)
        finally:
            self.table.unwatch(inst, queue)

    async def _next(self, queue: asyncio.Queue[object], timeout: float, started: bool,
                    inst: LiveInstance) -> Msg:
        try:  # asyncio.timeout, not wait_for: no task (and loop turns) per reply on the path
            async with asyncio.timeout(timeout):  # of every token (issue 31 item 6)
                item = await queue.get()
        except TimeoutError:
            if not started:
                raise _NotStarted(Timeout(f"instance {inst.id} did not accept within "
                                          f"{timeout}s")) from None
            raise Unavailable(f"the engine of instance {inst.id} sent nothing for "
                              f"{timeout}s") from None
        if isinstance(item, EngineGone):
            error = Unavailable(item.reason)
            raise _NotStarted(error) if not started else error
        assert isinstance(item, Msg)
        return item

    @staticmethod
    def _decode(msg: Msg) -> InferChunk | InferEnd | InferError:
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS and not msg.data:
            raise _NotStarted(Unavailable(f"no engine listens on {msg.subject}"))
        try:
            return InferReplyEnvelope.model_validate_json(msg.data).reply
        except ValidationError as exc:
            reason = exc.errors()[0]["msg"]
            raise Unavailable(f"malformed reply from the engine: {reason}") from None

    async def _abort(self, instance_id: str, request_id: str) -> None:
        try:
            await self.bus.publish(self.bus.subjects.abort(instance_id),
                                   AbortRequest(request_id=request_id))
        except Exception as exc:  # noqa: BLE001 - the connection may be closing
            log.warning("could not abort %s on %s: %s", request_id, instance_id, exc)

    async def call(self, model: str, request: BaseModel, reply_type: type[R],
                   timeout: float | None = None) -> R:
        """A one-reply request (tokenize / detokenize / embed) to the least loaded instance of
        `model`; `timeout` defaults to the bus' request timeout."""
        tried: list[str] = []
        last: ShoalError | None = None
        for _ in range(max(1, self.settings.gateway_max_attempts)):
            instance_id = (self._pick(model, (), tried) if tried
                           else await self._first_pick(model, ()))
            if instance_id is None:
                break
            tried.append(instance_id)
            try:
                return await self.bus.request(self.bus.subjects.infer(instance_id),
                                              InferRequestEnvelope(request=request), reply_type,  # type: ignore[arg-type]
                                              timeout=timeout)
            except (Unavailable, Timeout) as exc:
                last = exc
        if last is not None:
            raise last
        raise await self.no_instance(model)
