"""The bus's JetStream side: the namespace's event stream, publishing to it, and durable pull
consumers (ack after the handler, nak on error), as a part of Bus."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

import nats
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType, StreamConfig
from nats.js.errors import BadRequestError, NotFoundError
from pydantic import BaseModel

from shoal.shared.bus.codec import encode
from shoal.shared.bus.subjects import Subjects
from shoal.shared.config import Settings
from shoal.shared.telemetry import event_span, inject_headers

log = logging.getLogger(__name__)

EVENTS_MAX_AGE_S = 7 * 24 * 3600


class JetStreamEvents:
    """Bus's event methods: they use its JetStream context and subjects."""

    js: JetStreamContext
    subjects: Subjects
    settings: Settings

    async def ensure_events_stream(self) -> None:
        """Create the namespace's SHOAL_EVENTS_<ns> (idempotent; updated when its config
        drifted), on SHOAL_NATS_STREAM_REPLICAS servers of a NATS cluster (compose: 3, so
        the events outlive one server)."""
        config = StreamConfig(name=self.subjects.events_stream, subjects=[self.subjects.events_all],
                              storage=StorageType.FILE, max_age=EVENTS_MAX_AGE_S,
                              num_replicas=self.settings.nats_stream_replicas)
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
