"""Requesters that vanish (issue 32): an engine stops a request whose gateway is gone and records
the usage of what it had delivered.

How it knows: every reply of a generate request is published with a reply subject of this
engine's own, `<inbox>.<n>.<seq>`. NATS answers a publish that carries a reply subject and finds
no subscriber with "no responders" (a 503 status message to that reply subject, nats-server's
feature for requests; nats-py asks for it at CONNECT). A gateway subscribes its request's inbox
until the stream ends, and the server drops a closed connection's subscriptions at once, so the
first reply published after a gateway's SIGKILL comes back as a 503 naming the request and the
first seq it lost. No extra message for a stream that is fine, no heartbeat to tune, and it
works the same for our engine and a backend's adapter (both publish through `Replies`). A
request that publishes nothing (waiting in the queue) costs nothing meanwhile and is caught at
its first step.

Who records: a gateway that gives a request up while alive (its client left, a timeout) sends
the abort before it drops the inbox, and records the usage itself. So the engine waits
ABANDONED_GRACE_S after a 503: if no abort came, the requester died, and the engine records the
tokens of the replies published before the lost seq under the request's `UsageTag`
(its key, reservation and record id, which the registry counts once).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import ShoalError
from shoal.shared.schemas.infer import GenerateRequest
from shoal.shared.schemas.registry import UsageRecord

if TYPE_CHECKING:
    from shoal.services.engine.server.intake import Replies

log = logging.getLogger(__name__)
ABANDONED_GRACE_S = 1.0
"""After a 503, how long an abort from a live gateway may take to arrive (it was sent before the
gateway dropped the inbox, so it is normally already here)."""
RECORD_RETRY_S = 600.0
"""As long as a gateway retries a usage record (services/gateway/auth/quota.py)."""


@dataclass
class Watched:
    request: GenerateRequest
    replies: Replies
    task: asyncio.Task[object] | None
    aborted: bool = False
    """The requester gave the request up (an abort came): its gateway records the usage."""
    lost_seq: int | None = None
    """The first reply the requester did not receive."""


@dataclass
class Requesters:
    bus: Bus
    prefix: str = ""
    watched: dict[int, Watched] = field(default_factory=dict)
    by_request: dict[str, int] = field(default_factory=dict)
    abandoned: int = 0
    """Requests stopped because their requester was gone (tests and logs read it)."""
    _ids: Iterator[int] = field(default_factory=itertools.count)
    _pending: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self) -> None:
        self.prefix = self.bus.nc.new_inbox()
        await self.bus.nc.subscribe(f"{self.prefix}.>", cb=self.on_status)

    @contextlib.contextmanager
    def watching(self, req: GenerateRequest, replies: Replies) -> Iterator[None]:
        """Watch the request's replies while it is served (in its own task), and a little
        after: a 503 for its last reply may arrive once it has ended."""
        n = next(self._ids)
        self.watched[n] = Watched(req, replies, asyncio.current_task())
        self.by_request[req.request_id] = n
        replies.status_to = f"{self.prefix}.{n}"
        try:
            yield
        finally:
            asyncio.get_running_loop().call_later(2 * ABANDONED_GRACE_S, self._forget, n)

    def _forget(self, n: int) -> None:
        w = self.watched.pop(n, None)
        if w is not None and self.by_request.get(w.request.request_id) == n:
            del self.by_request[w.request.request_id]

    def aborted(self, request_id: str) -> None:
        n = self.by_request.get(request_id)
        if n is not None:
            self.watched[n].aborted = True

    async def on_status(self, msg: Msg) -> None:
        if not msg.headers or msg.headers.get("Status") != "503":
            return
        try:
            n, seq = (int(part) for part in msg.subject.rsplit(".", 2)[1:])
        except ValueError:
            return
        w = self.watched.get(n)
        if w is None:
            return
        first = w.lost_seq is None
        w.lost_seq = seq if first else min(seq, w.lost_seq)  # type: ignore[type-var]
        if not first:
            return
        if w.task is not None and not w.task.done():
            self.abandoned += 1
            w.task.cancel(msg="requester gone")  # the request's cleanup aborts it in the engine
        task = asyncio.create_task(self._settle(w))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _settle(self, w: Watched) -> None:
        await asyncio.sleep(ABANDONED_GRACE_S)
        if w.aborted:
            return  # a live gateway gave it up and records it
        assert w.lost_seq is not None
        usage = w.replies.delivered(w.lost_seq)
        log.warning("request %s: its requester is gone (no subscriber on its inbox); stopped "
                    "after delivering %d of %d replies, %d output tokens",
                    w.request.request_id, w.lost_seq, w.replies.seq, usage.completion_tokens)
        tag = w.request.usage
        if tag is None:
            return
        resumed = len(w.request.resume.token_ids) if w.request.resume is not None else 0
        record = UsageRecord(key_id=tag.key_id, model=tag.model, requests=tag.requests,
                             prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                             output_tokens=resumed + usage.completion_tokens,  # all delivered
                             batch_id=tag.record_id,
                             reservation_id=tag.reservation_id)
        await self._record(record)

    async def _record(self, record: UsageRecord) -> None:
        """Retried with back-off for up to RECORD_RETRY_S, as a gateway retries its own."""
        loop = asyncio.get_running_loop()
        deadline, delay = loop.time() + RECORD_RETRY_S, 0.5
        while True:
            try:
                await RegistryClient(self.bus).record_usage(record)
                return
            except ShoalError as exc:
                if loop.time() + delay > deadline:
                    log.error("usage of key %s lost (%s): %s", record.key_id, exc.message,
                              record.model_dump_json())
                    return
                await asyncio.sleep(delay)
                delay = min(2 * delay, 10.0)

    async def drain(self, timeout: float) -> None:
        """On stop: let the records in flight reach the registry."""
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)
