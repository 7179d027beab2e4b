"""Per-key limits and usage at the gateway: ask the registry before a request (only for keys
with limits), reserving the tokens it may spend (reservation.py), record its tokens after (every
key; for a reservation, also when nothing was spent: that gives it back), and add OpenAI's
x-ratelimit-* headers.

The counters live in Postgres behind the registry (services/registry/repo/quota.py says why), so
every gateway replica counts against the same limits. Usage of a key with limits is sent after
each request (its token limits and budget are read at its next admission); that of keys without
limits, which nothing reads back at once, is summed per key and model and sent in batches
(`gateway_usage_flush_interval` / `_requests`): one registry call for many requests. A gateway
keeps nothing that a stop could lose: it flushes the batch and awaits what is in flight. Nor
does a retry count twice: each record carries a batch id the registry counts once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web

from shoal.services.gateway.auth.ratelimit import ratelimit_headers, refusal
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.errors import ShoalError, Unavailable
from shoal.shared.schemas.infer import Usage, UsageTag
from shoal.shared.schemas.registry import MAX_LIMIT, ApiKeyVerified, QuotaAcquire, UsageRecord

log = logging.getLogger(__name__)
API_KEY: web.RequestKey[ApiKeyVerified] = web.RequestKey("shoal_api_key", ApiKeyVerified)
RATELIMIT_HEADERS: web.RequestKey[dict[str, str]] = web.RequestKey("shoal_ratelimit", dict)
RECORD_RETRY_S = 600.0
"""How long a usage record is retried while the registry cannot take it: as long as a key is
served from its last verification through a Postgres outage (SHOAL_GATEWAY_KEY_STALE_MAX's
default), so the chats of that outage are counted once it is back."""
RECORD_BACKOFF_MAX_S = 10.0


@dataclass(frozen=True, slots=True)
class Ticket:
    """One admitted request of a key, to record once it is done."""

    key_id: str
    model: str
    has_limits: bool = False
    reservation_id: str | None = None
    """Tokens the registry holds for this request until its record settles them."""


def usage_tag(ticket: Ticket | None, index: int = 0) -> UsageTag | None:
    """What the engine of a request's generate job `index` records should this gateway vanish
    mid-stream (the engine's server/requesters.py): the ticket's key and reservation, a record
    id of its own, and the request counted by its first job only."""
    if ticket is None:
        return None
    return UsageTag(key_id=ticket.key_id, model=ticket.model,
                    reservation_id=ticket.reservation_id, record_id=uuid.uuid4().hex,
                    requests=1 if index == 0 else 0)


class UsageBatch:
    """Usage summed per (key, model) until it is sent (pure: no I/O)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[str, str], UsageRecord] = {}
        self.num_requests = 0

    def add(self, record: UsageRecord) -> None:
        key = (record.key_id, record.model)
        known = self._rows.get(key)
        self._rows[key] = record if known is None else known.model_copy(update={
            name: getattr(known, name) + getattr(record, name)
            for name in ("requests", "prompt_tokens", "cached_tokens", "output_tokens")})
        self.num_requests += record.requests

    def take(self) -> list[UsageRecord]:
        rows, self._rows, self.num_requests = list(self._rows.values()), {}, 0
        return rows


class Quota:
    def __init__(self, registry: RegistryClient, retry_s: float = RECORD_RETRY_S,
                 clock: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 flush_interval: float = 1.0, flush_requests: int = 64) -> None:
        self.registry = registry
        self.retry_s = retry_s
        self.clock, self.sleep = clock, sleep
        self.flush_interval = flush_interval
        self.flush_requests = flush_requests
        self._batch = UsageBatch()
        self._pending: set[asyncio.Task[None]] = set()
        self._flusher: asyncio.Task[None] | None = None

    async def admit(self, request: web.Request, model: str,
                    tokens: Callable[[], int] | None = None) -> Ticket | None:
        """Count the request against its key's limits, reserving `tokens()` (the most it may
        spend; asked only of a key with limits, so no other request pays for the estimate)
        against its token limits (429 when over one); None without a key of the registry (keys
        not required, or the fixed --api-key). A reservation must be settled: record() or
        release() the ticket however the request ends."""
        key = request.get(API_KEY)
        if key is None or key.key_id is None:
            return None
        if not key.has_limits:
            return Ticket(key.key_id, model)
        try:
            grant = await self.registry.acquire_quota(QuotaAcquire(
                key_id=key.key_id, model=model,
                tokens=min(tokens() if tokens is not None else 0, MAX_LIMIT)))
        except ShoalError as exc:  # fail closed: a limited key is not let through unchecked
            raise Unavailable(f"cannot check this key's limits now: {exc.message}") from None
        request[RATELIMIT_HEADERS] = ratelimit_headers(grant)
        if not grant.allowed:
            raise refusal(grant)
        return Ticket(key.key_id, model, True, grant.reservation_id)

    def release(self, ticket: Ticket | None) -> None:
        """A request that spent nothing (refused before any token): not usage, but its
        reservation is given back."""
        if ticket is not None and ticket.reservation_id is not None:
            self._send_soon([UsageRecord(key_id=ticket.key_id, model=ticket.model, requests=0,
                                         reservation_id=ticket.reservation_id)])

    def record(self, ticket: Ticket | None, usage: Usage | None,
               record_id: str | None = None) -> None:
        """Record the request's tokens in the background (the answer does not wait for it).
        With `record_id` (a stream cut short: its engine may have recorded it too, under that
        id, see usage_tag) the record goes alone under that id, counted once whoever is first."""
        if ticket is None:
            return
        usage = usage or Usage(prompt_tokens=0, completion_tokens=0)
        record = UsageRecord(key_id=ticket.key_id, model=ticket.model,
                             prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                             output_tokens=usage.completion_tokens,
                             reservation_id=ticket.reservation_id, batch_id=record_id)
        if ticket.has_limits or record_id is not None:
            self._send_soon([record])
            return
        self._batch.add(record)
        if self._batch.num_requests >= self.flush_requests:
            self.flush()
        elif self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_later())

    def flush(self) -> None:
        """Send the batch now (in the background)."""
        if self._flusher is not None and self._flusher is not asyncio.current_task():
            self._flusher.cancel()
        self._flusher = None
        self._send_soon(self._batch.take())

    async def _flush_later(self) -> None:
        await asyncio.sleep(self.flush_interval)
        self._flusher = None
        self.flush()

    def _send_soon(self, records: list[UsageRecord]) -> None:
        """Each record gets its batch id here, once: its retries carry the same id, so a retry
        after a reply that timed out (the registry had committed) is not counted twice."""
        for record in records:
            record = record.model_copy(update={"batch_id": record.batch_id or uuid.uuid4().hex})
            task = asyncio.create_task(self._send(record))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

    async def _send(self, record: UsageRecord) -> None:
        """Retried with back-off (0.5 s doubling to 10 s) for up to `retry_s`: one warning when
        the first attempt fails, one error if the record is lost."""
        deadline, delay = self.clock() + self.retry_s, 0.5
        while True:
            try:
                await self.registry.record_usage(record)
                return
            except ShoalError as exc:
                if delay == 0.5:
                    log.warning("recording usage of key %s failed (%s); retrying for up to "
                                "%.0fs", record.key_id, exc.message, self.retry_s)
                if self.clock() + delay > deadline:
                    break
                await self.sleep(delay)
                delay = min(2 * delay, RECORD_BACKOFF_MAX_S)
        log.error("usage of key %s lost: %s", record.key_id, record.model_dump_json())

    async def drain(self, timeout: float = 30.0) -> None:
        """On stop: send the batch and let the records in flight reach the registry."""
        if self._flusher is not None:
            self._flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._flusher
        self.flush()
        if self._pending:
            await asyncio.wait(list(self._pending), timeout=timeout)


async def add_ratelimit_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: the key's x-ratelimit-* headers on every answer, streams included."""
    for name, value in request.get(RATELIMIT_HEADERS, {}).items():
        response.headers.setdefault(name, value)
