"""The bus: one NATS connection per process with typed request/reply, publish and JetStream.

Every payload is a pydantic model (shared/schemas); replies that carry `{"error": ...}` and the
micro error headers are raised back as the ShoalError kind the server raised. Connecting retries
with back-off until `settings.connect_timeout`, then nats-py reconnects forever.
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
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel, ValidationError

from shoal.shared.bus.subjects import Subjects
from shoal.shared.config import Settings
from shoal.shared.errors import (
    InvalidRequest, PayloadTooLarge, ShoalError, Timeout, Unavailable
)
from shoal.shared.schemas.common import ErrorReply
from shoal.shared.telemetry import event_span, inject_headers

log = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)
ERROR_CODE_HEADER = "Nats-Service-Error-Code"
ERROR_HEADER = "Nats-Service-Error"
EVENTS_MAX_AGE_S = 7 * 24 * 3600


def encode(payload: BaseModel) -> bytes:
    """A partial update (a model with `partial = True`, e.g. ModelUpdate) sends only the fields
    that were set, so the receiver can tell "leave as is" from "set to null"."""
    partial = bool(getattr(payload, "partial", False))
    return payload.model_dump_json(exclude_unset=partial).encode()


def decode(data: bytes, model: type[T]) -> T:
    """Parse a payload; a malformed one is an InvalidRequest naming what is wrong."""
    try:
        return model.model_validate_json(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or None
        raise InvalidRequest(f"malformed {model.__name__}: {where or 'body'}: {first['msg']}",
                             param=where) from None


def too_large(nc: NATS, data: bytes, what: str = "the request") -> PayloadTooLarge:
    """Why a message cannot go on the bus: the server's max_payload (README "The largest
    request"), so the client gets a 413, not a 500."""
    return PayloadTooLarge(f"{what} is {len(data)} bytes on the bus; the NATS server "
                           f"carries at most {nc.max_payload} bytes (its max_payload)")


def raise_for_error(msg: Msg) -> None:
    """Raise the ShoalError carried by an error reply (micro error headers + ErrorReply body)."""
    code = (msg.headers or {}).get(ERROR_CODE_HEADER)
    if code is None:
        return
    try:
        body = ErrorReply.model_validate_json(msg.data).error.model_dump()
    except ValidationError:
        body = {"message": (msg.headers or {}).get(ERROR_HEADER, "error"), "type": ""}
    raise ShoalError.from_dict(body, status=int(code) if code.isdigit() else None)


def error_body(exc: ShoalError) -> bytes:
    return ErrorReply.model_validate({"error": exc.to_dict()}).model_dump_json().encode()


def error_headers(exc: ShoalError) -> dict[str, str]:
    return {ERROR_CODE_HEADER: str(exc.http_status), ERROR_HEADER: exc.message[:200]}


class Bus:
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
                    max_reconnect_attempts=-1, reconnect_time_wait=1, error_cb=_log_error,
                    disconnected_cb=_on_disconnected(holder),
                    reconnected_cb=_on_reconnected(holder),
                )
                holder.append(cls(nc, settings))
                return holder[0]
            except (OSError, NatsTimeout, nats.errors.NoServersError) as exc:
                if asyncio.get_running_loop().time() + delay > deadline:
                    raise Unavailable(f"cannot reach NATS at {_redacted(settings.nats_url)}: "
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

    # ------------------------------------------------------------ JetStream events
    async def ensure_events_stream(self) -> None:
        """Create the namespace's SHOAL_EVENTS_<ns> (idempotent; updated when its config
        drifted)."""
        config = StreamConfig(name=self.subjects.events_stream, subjects=[self.subjects.events_all],
                              storage=StorageType.FILE, max_age=EVENTS_MAX_AGE_S)
        try:
            await self.js.add_stream(config)
        except BadRequestError:
            await self.js.update_stream(config)

    async def publish_event(self, subject: str, payload: BaseModel) -> None:
        await self.js.publish(subject, encode(payload), headers=inject_headers())

    async def consume(self, durable: str, subject: str, handler: Callable[[Msg], Awaitable[None]],
                      stop: asyncio.Event, batch: int = 64) -> None:
        """Run a durable pull consumer until `stop` is set: ack after the handler, nak on error.

        Several processes consuming the same durable share the work (each event to one of them).
        """
        await self.ensure_events_stream()
        sub = await self.js.pull_subscribe(
            subject, durable=durable, stream=self.subjects.events_stream,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.NEW,
                                  max_deliver=10, ack_wait=30),
        )
        try:
            while not stop.is_set():
                try:
                    msgs = await sub.fetch(batch, timeout=1.0)
                except (TimeoutError, NatsTimeout):  # nats-py raises either when idle
                    continue
                except (NotFoundError, nats.errors.ConnectionClosedError):
                    if stop.is_set():
                        return
                    raise
                for msg in msgs:
                    try:
                        with event_span(msg.subject, msg.headers):
                            await handler(msg)
                        await msg.ack()
                    except Exception:  # noqa: BLE001 - redelivered later, with a delay
                        log.exception("event handler failed for %s", msg.subject)
                        await msg.nak(delay=1.0)
        finally:
            # an open pull subscription makes drain() wait its full 30 s timeout
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

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


def _redacted(urls: str) -> str:
    from shoal.shared.embedded import redact_url

    return ",".join(redact_url(url.strip()) for url in urls.split(","))


def _log_event(holder: list[Bus], text: str) -> Callable[[], Awaitable[None]]:
    async def callback() -> None:
        if not (holder and holder[0].closing):
            log.warning(text)

    return callback


def _on_disconnected(holder: list[Bus]) -> Callable[[], Awaitable[None]]:
    log_it = _log_event(holder, "disconnected from NATS")

    async def callback() -> None:
        await log_it()
        if not holder or holder[0].closing:
            return
        for hook in holder[0].on_disconnect:
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook must not stop the others
                log.exception("disconnect hook failed")

    return callback


def _on_reconnected(holder: list[Bus]) -> Callable[[], Awaitable[None]]:
    log_it = _log_event(holder, "reconnected to NATS")

    async def callback() -> None:
        await log_it()
        for hook in holder[0].on_reconnect if holder else ():
            try:
                hook()
            except Exception:  # noqa: BLE001 - one hook must not stop the others
                log.exception("reconnect hook failed")

    return callback


async def _log_error(exc: Exception) -> None:
    log.warning("NATS error: %s", exc)
