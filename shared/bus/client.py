"""The bus: one NATS connection per process with typed request/reply, publish and JetStream.

Every payload is a pydantic model (shared/schemas); replies that carry `{"error": ...}` and the
micro error headers are raised back as the ShoalError kind the server raised. Connecting retries
with back-off until `settings.connect_timeout`, then nats-py reconnects forever.

Beside it: `codec.py` (payloads and error replies as bytes), `events.py` (JetStream: the event
stream and durable consumers, a part of Bus), `connection.py` (what the connection reports).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import MaxPayloadError, NoRespondersError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from pydantic import BaseModel

from shoal.shared.bus.codec import (
    decode, encode, error_body, error_headers, raise_for_error, too_large
)
from shoal.shared.bus.connection import log_error, on_disconnected, on_reconnected, redacted
from shoal.shared.bus.events import JetStreamEvents
from shoal.shared.bus.subjects import Subjects
from shoal.shared.config import Settings
from shoal.shared.errors import InvalidRequest, ShoalError, Timeout, Unavailable
from shoal.shared.telemetry import event_span, inject_headers

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)


class Bus(JetStreamEvents):
    def __init__(self, nc: NATS, settings: Settings) -> None:
        self.nc = nc
        self.closing = False
        self.on_reconnect: list[Callable[[], None]] = []
        """Called after every reconnection (what a caller caches from events may be stale)."""
        self.on_disconnect: list[Callable[[], None]] = []
        """Called when the connection is lost (messages in flight may be lost with it)."""
        self.js: JetStreamContext = nc.jetstream()
        self.settings = settings
        self.subjects = Subjects(settings.ns)

    @classmethod
    async def connect(cls, settings: Settings, name: str) -> Bus:
        if not settings.nats_url:
            raise Unavailable("no NATS URL: set SHOAL_NATS_URL or start the stack with `shoal up`")
        servers = [s.strip() for s in settings.nats_url.split(",") if s.strip()]
        deadline = asyncio.get_running_loop().time() + settings.connect_timeout
        delay = 0.1
        while True:
            try:
                holder: list[Bus] = []
                nc = await nats.connect(
                    servers, name=name, connect_timeout=2, allow_reconnect=True,
                    max_reconnect_attempts=-1, reconnect_time_wait=1, error_cb=log_error,
                    disconnected_cb=on_disconnected(holder),
                    reconnected_cb=on_reconnected(holder),
                )
                holder.append(cls(nc, settings))
                return holder[0]
            except (OSError, NatsTimeout, nats.errors.NoServersError) as exc:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise Unavailable(f"cannot reach NATS at {redacted(settings.nats_url)}: "
                                      f"{exc}") from exc
                log.info("NATS not reachable yet (%s), retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)

    async def close(self) -> None:
        self.closing = True
        if not self.nc.is_closed:
            try:
                await self.nc.drain()
            except Exception:  # noqa: BLE001 - closing is best effort
                await self.nc.close()

    # ------------------------------------------------------------ request / reply
    async def request(self, subject: str, payload: BaseModel, reply_type: type[T],
                      timeout: float | None = None, headers: dict[str, str] | None = None) -> T:
        """Send a typed request and return the typed reply, or raise the server's error.
        While NATS is away the answer is Unavailable at once (a 503), not a timeout later."""
        if not self.nc.is_connected:
            raise Unavailable("NATS is unreachable (reconnecting); retry shortly")
        data = encode(payload)
        try:
            msg = await self.nc.request(subject, data,
                                        timeout=timeout or self.settings.request_timeout,
                                        headers=inject_headers(headers))
        except MaxPayloadError:
            raise too_large(self.nc, data) from None
        except NoRespondersError:
            raise Unavailable(f"no service answers on {subject}") from None
        except (nats.errors.ConnectionClosedError, nats.errors.ConnectionReconnectingError,
                nats.errors.OutboundBufferLimitError, nats.errors.StaleConnectionError):
            raise Unavailable("NATS connection lost; retry shortly") from None
        except NatsTimeout:
            waited = timeout or self.settings.request_timeout
            raise Timeout(f"no reply on {subject} within {waited}s") from None
        raise_for_error(msg)
        return decode(msg.data, reply_type)

    async def publish(self, subject: str, payload: BaseModel,
                      headers: dict[str, str] | None = None) -> None:
        data = encode(payload)
        try:
            await self.nc.publish(subject, data, headers=inject_headers(headers))
        except MaxPayloadError:
            raise too_large(self.nc, data) from None

    async def subscribe(self, subject: str, model: type[T],
                        handler: Callable[[T, Msg], Awaitable[None]],
                        queue: str = "") -> nats.aio.subscription.Subscription:
        """Subscribe with a typed handler; malformed messages are logged and dropped."""

        async def on_msg(msg: Msg) -> None:
            try:
                payload = decode(msg.data, model)
            except InvalidRequest as exc:
                log.warning("dropping malformed message on %s: %s", msg.subject, exc.message)
                return
            try:
                with event_span(msg.subject, msg.headers):
                    await handler(payload, msg)
            except Exception:  # noqa: BLE001 - one bad message must not kill the subscription
                log.exception("handler for %s failed", msg.subject)

        return await self.nc.subscribe(subject, queue=queue, cb=on_msg)

    async def respond_error(self, msg: Msg, exc: ShoalError) -> None:
        """Answer a plain (non-micro) request with the same error format the registry uses."""
        if msg.reply:
            await self.nc.publish(msg.reply, error_body(exc), headers=error_headers(exc))


    @contextlib.asynccontextmanager
    async def streamed_request(self, subject: str, payload: BaseModel,
                               headers: dict[str, str] | None = None,
                               queue: asyncio.Queue[Any] | None = None
                               ) -> AsyncIterator[asyncio.Queue[Any]]:
        """Publish a request whose replies stream to its own inbox, and give the queue they
        arrive in (as Msg) until the context ends. Pass your own `queue` to have other producers
        put into it too (the gateway's instance table puts an EngineGone when the engine dies)."""
        queue = asyncio.Queue() if queue is None else queue
        inbox = self.nc.new_inbox()
        sub = await self.nc.subscribe(inbox, cb=queue.put)
        try:
            data = encode(payload)
            try:
                await self.nc.publish(subject, data, reply=inbox, headers=inject_headers(headers))
            except MaxPayloadError:
                raise too_large(self.nc, data) from None
            yield queue
        finally:
            await sub.unsubscribe()

    async def stream_replies(self, subject: str, payload: BaseModel,
                             headers: dict[str, str] | None = None) -> AsyncIterator[Msg]:
        """Publish a request and yield every reply sent to its inbox (streamed replies)."""
        async with self.streamed_request(subject, payload, headers) as queue:
            while True:
                yield await queue.get()
