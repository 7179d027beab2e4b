"""Scatter-gather on the bus: publish one request and collect every answer that comes within a
short wait (the answering processes subscribe without a queue group, so each one answers). How
a gateway lists every process's /metrics, and how the CLI learns what the gateways require."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from pydantic import BaseModel, ValidationError

from shoal.shared.bus.client import Bus
from shoal.shared.bus.codec import encode

T = TypeVar("T", bound=BaseModel)
GATHER_WAIT_S = 0.5
"""How long answers are gathered."""


async def gather(bus: Bus, subject: str, model: type[T], wait: float = GATHER_WAIT_S) -> list[T]:
    """Every well-formed answer to an empty request on `subject` within `wait` seconds."""
    found: list[T] = []
    inbox = bus.nc.new_inbox()

    async def on_reply(msg: Msg) -> None:
        try:
            found.append(model.model_validate_json(msg.data))
        except ValidationError:
            return

    sub = await bus.nc.subscribe(inbox, cb=on_reply)
    try:
        await bus.nc.publish(subject, b"{}", reply=inbox)
        await asyncio.sleep(wait)
    finally:
        await sub.unsubscribe()
    return found


async def answer(bus: Bus, subject: str, reply: BaseModel) -> Subscription:
    """Reply with `reply` to every request on `subject` (no queue group: all answer)."""

    async def on_request(msg: Msg) -> None:
        if msg.reply:
            await bus.nc.publish(msg.reply, encode(reply))

    return await bus.nc.subscribe(subject, cb=on_request)
