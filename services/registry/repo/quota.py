"""Per-key limits and usage, counted in Postgres so every gateway replica shares them.

Why Postgres and not a NATS JetStream KV bucket: a request may fall under several limits (its
model's and the key's all-models one) and must count against all of them or none; Postgres does
that in one transaction with conditional upserts (`... ON CONFLICT DO UPDATE ... WHERE requests
< rpm`), which serialise on the window's row, so N concurrent requests through any number of
gateways get exactly `rpm` admissions. JetStream KV has compare-and-set on one key at a time,
so the same needs a retry loop per key and cannot undo the first key when the second refuses.
The usage per key/model/day must be in Postgres anyway (reports, budgets that survive restarts),
and the registry is already its only writer.

Windows are fixed UTC minutes (Retry-After: until the next one). Request limits are exact.
Token limits hold by reservation: an admission reserves the most the request can spend (its
prompts' estimate plus prompts x n x max_tokens, `QuotaAcquire.tokens`), refused when that does
not fit what the limit has left; the reserved tokens count in the minute's token window and
against budgets (`quota_reservations`) until the request's usage record settles them (the
unused part given back, also for a failed or abandoned request). Admissions of one key are
serialised on its row (`SELECT ... FOR UPDATE`), so concurrent requests through any number of
gateways cannot reserve the same tokens twice. Only a prompt longer than its estimate can pass a
limit, by the difference (OpenAI's limiter also admits on an estimate).
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import delete, func, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from shoal.services.registry.repo.api_keys import ApiKeyRepo
from shoal.shared.db.tables import (
    ApiKeyRow, ApiKeyUsageRow, QuotaReservationRow, RateWindowRow, UsageBatchRow
)
from shoal.shared.errors import Unauthorized
from shoal.shared.schemas.registry import (
    KeyLimit, QuotaAcquire, QuotaGrant, UsageQuery, UsageRecord, UsageReport, UsageRow
)

BATCH_ID_KEEP_S = 86400.0
"""How long a counted usage record's id is kept (gateways retry one for 10 minutes at most)."""
ALL_MODELS = "*"
"""The model column of counters that count every model (no model name can be "*")."""
RESERVATION_KEEP_S = 3600.0
"""How long a reservation whose usage record never came (its gateway died) counts against
budgets; a request's record comes when it ends, and a gateway retries one for 10 minutes."""


@dataclass
class _Denied(Exception):
    grant: QuotaGrant


def _scope(limit: KeyLimit) -> str:
    return limit.model or ALL_MODELS


class QuotaRepo:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self.sessions = sessions

    async def acquire(self, req: QuotaAcquire, now: float | None = None) -> QuotaGrant:
        now = time.time() if now is None else now
        window = int(now // 60)
        reset = (window + 1) * 60 - now
        try:
            async with self.sessions() as s, s.begin():
                # one admission of this key at a time: two cannot reserve the same tokens
                key = await s.get(ApiKeyRow, req.key_id, with_for_update=True)
                if key is None or key.revoked_at is not None:
                    raise Unauthorized("invalid, expired or revoked API key")
                limits = [KeyLimit(**x) for x in key.limits or []]
                limits = [x for x in limits if x.model in (None, req.model)]
                grant = QuotaGrant(allowed=True)
                await s.execute(delete(QuotaReservationRow).where(
                    QuotaReservationRow.key_id == req.key_id,
                    QuotaReservationRow.expires_at < datetime.fromtimestamp(now, UTC)))
                await self._check_tokens(s, req, limits, window, reset, grant, now)
                await self._count_request(s, req, limits, window, reset, grant)
                if req.tokens and any(x.tpm or x.token_budget for x in limits):
                    grant.reservation_id = await self._reserve(s, req, window, now)
                # windows older than the last one are history
                await s.execute(delete(RateWindowRow).where(RateWindowRow.key_id == req.key_id,
                                                            RateWindowRow.window < window - 1))
                return grant
        except _Denied as denied:  # the transaction rolled back: nothing was counted
            return denied.grant

    async def _check_tokens(self, s: AsyncSession, req: QuotaAcquire, limits: list[KeyLimit],
                            window: int, reset: float, grant: QuotaGrant, now: float) -> None:
        """Each token limit must hold the request's reservation (at least one token): the
        grant reports what the tightest leaves after it."""
        need = max(req.tokens, 1)
        for limit in limits:
            if limit.tpm is not None:
                used = await s.scalar(select(RateWindowRow.tokens).where(
                    RateWindowRow.key_id == req.key_id, RateWindowRow.model == _scope(limit),
                    RateWindowRow.window == window)) or 0
                self._tighter(grant, limit.tpm, limit.tpm - used - req.tokens, reset)
                if used + need > limit.tpm:
                    never = need > limit.tpm  # waiting does not help: no Retry-After
                    raise _Denied(grant.model_copy(update={
                        "allowed": False, "code": "rate_limit_exceeded",
                        "retry_after": None if never else reset,
                        "limit_tokens": limit.tpm, "remaining_tokens": max(0, limit.tpm - used),
                        "reset_tokens": reset,
                        "message": f"Rate limit reached for {_what(limit)} on tokens per min "
                                   f"(TPM): Limit {limit.tpm}, Used {used}, Requested "
                                   f"{req.tokens}. {_advice(never, reset)}"}))
            if limit.token_budget is not None:
                spent = await self._spent(s, req.key_id, limit.model, now)
                self._tighter(grant, limit.token_budget, limit.token_budget - spent - req.tokens,
                              None)
                if spent + need > limit.token_budget:
                    raise _Denied(grant.model_copy(update={
                        "allowed": False, "code": "insufficient_quota",
                        "limit_tokens": limit.token_budget,
                        "remaining_tokens": max(0, limit.token_budget - spent),
                        "reset_tokens": None,
                        "message": f"You exceeded your token budget for {_what(limit)}: "
                                   f"{spent} of {limit.token_budget} tokens spent or reserved, "
                                   f"this request may need {req.tokens} (its prompt and "
                                   f"prompts x n x max_tokens)."}))

    @staticmethod
    def _tighter(grant: QuotaGrant, limit: int, remaining: int, reset: float | None) -> None:
        """Report the token limit with the fewest tokens left (a budget: no reset)."""
        remaining = max(0, remaining)
        if grant.remaining_tokens is None or remaining < grant.remaining_tokens:
            grant.limit_tokens, grant.remaining_tokens = limit, remaining
            grant.reset_tokens = reset

    @staticmethod
    async def _spent(s: AsyncSession, key_id: str, model: str | None, now: float) -> int:
        """Tokens used plus those reserved by requests in flight, in one statement (one
        snapshot: a record that settles a reservation meanwhile is seen whole or not at all)."""
        used = select(func.coalesce(func.sum(
            ApiKeyUsageRow.prompt_tokens + ApiKeyUsageRow.output_tokens), 0)).where(
            ApiKeyUsageRow.key_id == key_id)
        held = select(func.coalesce(func.sum(QuotaReservationRow.tokens), 0)).where(
            QuotaReservationRow.key_id == key_id,
            QuotaReservationRow.expires_at >= datetime.fromtimestamp(now, UTC))
        if model is not None:
            used = used.where(ApiKeyUsageRow.model == model)
            held = held.where(QuotaReservationRow.model == model)
        return int(await s.scalar(select(used.scalar_subquery() + held.scalar_subquery())) or 0)

    @staticmethod
    async def _reserve(s: AsyncSession, req: QuotaAcquire, window: int, now: float) -> str:
        """Hold the request's tokens: in this minute's token windows (its model's and all
        models'), and as a reservation row that budgets count and its record settles."""
        await QuotaRepo._add_tokens(s, req.key_id, req.model, window, req.tokens)
        reservation_id = uuid.uuid4().hex
        s.add(QuotaReservationRow(
            id=reservation_id, key_id=req.key_id, model=req.model, window=window,
            tokens=req.tokens,
            expires_at=datetime.fromtimestamp(now + RESERVATION_KEEP_S, UTC)))
        return reservation_id

    async def _count_request(self, s: AsyncSession, req: QuotaAcquire, limits: list[KeyLimit],
                             window: int, reset: float, grant: QuotaGrant) -> None:
        # all models' row first, as records write them: two transactions never wait on each
        # other's rows in opposite orders (a deadlock)
        for limit in sorted(limits, key=_scope):
            if limit.rpm is None:
                continue
            table = RateWindowRow.__table__
            stmt = insert(RateWindowRow).values(key_id=req.key_id, model=_scope(limit),
                                                window=window, requests=1, tokens=0)
            stmt = stmt.on_conflict_do_update(
                index_elements=[table.c.key_id, table.c.model, table.c.window],
                set_={"requests": table.c.requests + 1},
                where=table.c.requests < limit.rpm,
            ).returning(table.c.requests)
            count = await s.scalar(stmt)
            if count is None:  # the window is full: this row was not updated
                raise _Denied(grant.model_copy(update={
                    "allowed": False, "code": "rate_limit_exceeded", "retry_after": reset,
                    "limit_requests": limit.rpm, "remaining_requests": 0,
                    "reset_requests": reset,
                    "message": f"Rate limit reached for {_what(limit)} on requests per min "
                               f"(RPM): Limit {limit.rpm}, Used {limit.rpm}, Requested 1. "
                               f"Please try again in {reset:.0f}s."}))
            remaining = limit.rpm - int(count)
            if grant.remaining_requests is None or remaining < grant.remaining_requests:
                grant.limit_requests, grant.remaining_requests = limit.rpm, remaining
                grant.reset_requests = reset

    async def record(self, req: UsageRecord, now: float | None = None) -> UsageRecord:
        """Add the request's usage to the day's row and its tokens to the token windows; a
        record that settles a reservation replaces the reserved tokens with these, in the
        reservation's window (a refusal with no usage only gives the reservation back)."""
        now = time.time() if now is None else now
        day = datetime.fromtimestamp(now, UTC).date()
        tokens = req.prompt_tokens + req.output_tokens
        usage = ApiKeyUsageRow.__table__
        async with self.sessions() as s, s.begin():
            if req.batch_id is not None and not await self._first_time(s, req.batch_id, now):
                return req  # counted already: a retry whose first reply was lost
            if req.requests or tokens or req.cached_tokens:
                stmt = insert(ApiKeyUsageRow).values(
                    key_id=req.key_id, model=req.model, day=day, requests=req.requests,
                    prompt_tokens=req.prompt_tokens, cached_tokens=req.cached_tokens,
                    output_tokens=req.output_tokens)
                await s.execute(stmt.on_conflict_do_update(
                    index_elements=[usage.c.key_id, usage.c.model, usage.c.day],
                    set_={name: usage.c[name] + stmt.excluded[name] for name in
                          ("requests", "prompt_tokens", "cached_tokens", "output_tokens")}))
            held = None
            if req.reservation_id is not None:
                held = (await s.execute(delete(QuotaReservationRow).where(
                    QuotaReservationRow.id == req.reservation_id,
                    QuotaReservationRow.key_id == req.key_id).returning(
                    QuotaReservationRow.window, QuotaReservationRow.tokens))).first()
            if held is None:  # nothing reserved, or it expired: the tokens count now
                await self._add_tokens(s, req.key_id, req.model, int(now // 60), tokens)
            else:
                await self._settle(s, req.key_id, req.model, held.window, tokens - held.tokens)
        return req

    @staticmethod
    async def _add_tokens(s: AsyncSession, key_id: str, model: str, window: int,
                          tokens: int) -> None:
        if not tokens:
            return
        windows = RateWindowRow.__table__
        for scope in (ALL_MODELS, model):
            ins = insert(RateWindowRow).values(key_id=key_id, model=scope, window=window,
                                               requests=0, tokens=tokens)
            await s.execute(ins.on_conflict_do_update(
                index_elements=[windows.c.key_id, windows.c.model, windows.c.window],
                set_={"tokens": windows.c.tokens + tokens}))

    @staticmethod
    async def _settle(s: AsyncSession, key_id: str, model: str, window: int,
                      delta: int) -> None:
        """Correct the reservation's windows by what was used less what was reserved (windows
        already deleted are history: nothing to correct)."""
        if not delta:
            return
        for scope in (ALL_MODELS, model):
            await s.execute(update(RateWindowRow).where(
                RateWindowRow.key_id == key_id, RateWindowRow.model == scope,
                RateWindowRow.window == window).values(
                tokens=func.greatest(RateWindowRow.tokens + delta, 0)))

    @staticmethod
    async def _first_time(s: AsyncSession, batch_id: str, now: float) -> bool:
        """Note `batch_id` as counted, in the record's transaction; False when it already was.
        Ids older than BATCH_ID_KEEP_S go (a sender retries for far less)."""
        at = datetime.fromtimestamp(now, UTC)
        await s.execute(delete(UsageBatchRow).where(
            UsageBatchRow.recorded_at < datetime.fromtimestamp(now - BATCH_ID_KEEP_S, UTC)))
        noted = await s.scalar(insert(UsageBatchRow).values(id=batch_id, recorded_at=at)
                               .on_conflict_do_nothing().returning(UsageBatchRow.id))
        return noted is not None

    async def usage(self, req: UsageQuery) -> UsageReport:
        query = (select(ApiKeyUsageRow, ApiKeyRow.name)
                 .join(ApiKeyRow, ApiKeyRow.id == ApiKeyUsageRow.key_id)
                 .order_by(ApiKeyUsageRow.day, ApiKeyRow.name, ApiKeyUsageRow.model))
        if req.model is not None:
            query = query.where(ApiKeyUsageRow.model == req.model)
        if req.since is not None:
            query = query.where(ApiKeyUsageRow.day >= req.since)
        if req.until is not None:
            query = query.where(ApiKeyUsageRow.day <= req.until)
        async with self.sessions() as s:
            if req.key_id is not None:  # an id or a name; no such key is a 404, not "no usage"
                key = await ApiKeyRepo.resolve(s, req.key_id)
                query = query.where(ApiKeyUsageRow.key_id == key.id)
            rows = (await s.execute(query.limit(10000))).all()
        return UsageReport(rows=[UsageRow(
            key_id=u.key_id, key_name=name, model=u.model, day=u.day, requests=u.requests,
            prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
            output_tokens=u.output_tokens) for u, name in rows])


def _what(limit: KeyLimit) -> str:
    return f"model {limit.model}" if limit.model else "all models"


def _advice(never: bool, reset: float) -> str:
    if never:
        return ("The request can never fit this limit: lower max_tokens, n or the number of "
                "prompts.")
    return f"Please try again in {reset:.0f}s."
