"""API keys, their limits, quotas and usage on the wire: create / update / public views, the
gateway's verify, acquire (before a request) and usage record (after it), and usage reports."""

from __future__ import annotations

from datetime import date, datetime
from enum import Enum
from typing import ClassVar

from pydantic import Field, field_validator, model_validator

from shoal.shared.schemas.common import Wire
from shoal.shared.schemas.registry.requests import NAME_PATTERN


MAX_LIMIT = 10**15
"""The largest rpm, tpm or token_budget (and token reservation): the counters are Postgres
BIGINTs (to 9.2e18), which this leaves room to add to, and dashboards read it exactly (below
JavaScript's 2**53). A larger number is a 400 naming the field, not a key that fails later."""
MAX_VERSION = 2**31 - 1
"""Row versions are Postgres INTEGERs."""
SECRET_PREFIX = "sk-shoal-"
"""Every secret the registry makes begins so: a gateway can tell a Shoal key from a placeholder
token (vLLM's `EMPTY`) without asking, and refuse the latter where keys are required."""


class ApiKeyScope(str, Enum):
    INFERENCE = "inference"
    """The OpenAI-compatible API (/v1/*, /tokenize, /detokenize) only."""
    ADMIN = "admin"
    """Everything: inference and the management API (/api/v1/*, the dashboard's data)."""


class KeyLimit(Wire):
    """Limits of one key on one model (`model` set) or on all its models together (unset).
    Each number is optional; unset means unlimited."""

    model: str | None = None
    rpm: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    """Requests per minute (fixed one-minute windows)."""
    tpm: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    """Tokens per minute: prompt + output tokens of the requests admitted in the window (each
    reserves its most at admission, settled to its usage when it ends)."""
    token_budget: int | None = Field(default=None, ge=1, le=MAX_LIMIT)
    """Total tokens (prompt + output) ever, reservations of requests in flight included; spent,
    the key gets 429 insufficient_quota."""

    @model_validator(mode="after")
    def _some_limit(self) -> KeyLimit:
        if self.rpm is None and self.tpm is None and self.token_budget is None:
            raise ValueError("a limit needs rpm, tpm or token_budget")
        return self


def _distinct_scopes(limits: list[KeyLimit]) -> list[KeyLimit]:
    seen = [limit.model for limit in limits]
    if len(seen) != len(set(seen)):
        raise ValueError("one limit per model (and one for all models)")
    return limits


class ApiKeyCreate(Wire):
    name: str = Field(pattern=NAME_PATTERN)
    expires_at: datetime | None = None
    scope: ApiKeyScope | None = None
    """Unset: admin while no usable admin key exists (the bootstrap key), else inference."""
    limits: list[KeyLimit] = Field(default_factory=list, max_length=64)

    @field_validator("limits")
    @classmethod
    def _check_limits(cls, limits: list[KeyLimit]) -> list[KeyLimit]:
        return _distinct_scopes(limits)


class ApiKeyUpdate(Wire):
    """Change a key's scope or replace its limits (send the version you read)."""

    partial: ClassVar[bool] = True

    id: str
    """The key's id, or its name (the registry resolves it)."""
    version: int | None = Field(default=None, ge=0, le=MAX_VERSION)
    """The version read (a stale one: 409); unset: no check."""
    scope: ApiKeyScope | None = None
    limits: list[KeyLimit] | None = Field(default=None, max_length=64)

    @field_validator("limits")
    @classmethod
    def _check_limits(cls, limits: list[KeyLimit] | None) -> list[KeyLimit] | None:
        return None if limits is None else _distinct_scopes(limits)


class ApiKeyPublic(Wire):
    id: str
    name: str
    prefix: str
    """The first characters of the secret, to recognise a key; never enough to use it."""
    created_at: datetime
    expires_at: datetime | None = None
    revoked_at: datetime | None = None
    scope: ApiKeyScope = ApiKeyScope.ADMIN
    limits: list[KeyLimit] = Field(default_factory=list)
    version: int


class ApiKeyCreated(ApiKeyPublic):
    secret: str
    """Shown once: only its hash is stored."""


class ApiKeyVerify(Wire):
    secret: str


class ApiKeyVerified(Wire):
    valid: bool
    key_id: str | None = None
    name: str | None = None
    scope: ApiKeyScope | None = None
    has_limits: bool = False
    """The gateway asks the registry's quota before each request only for such keys."""
    expires_in: float | None = None
    """Seconds until a valid key expires (None: never): a gateway caches it no longer."""


# ---------------------------------------------------------------- quotas and usage
class QuotaAcquire(Wire):
    """Before a request: count it against the key's limits for `model` (all or nothing), and
    reserve `tokens` (the most it can spend: its prompts' estimate plus prompts x n x
    max_tokens) against its token limits until its usage is recorded."""

    key_id: str
    model: str
    tokens: int = Field(default=0, ge=0, le=MAX_LIMIT)


class QuotaGrant(Wire):
    """The answer: allowed or not, and what OpenAI's x-ratelimit-* headers report (the tightest
    of the key's request and token limits that apply; None where none applies)."""

    allowed: bool
    code: str | None = None
    """rate_limit_exceeded (requests or tokens per minute) or insufficient_quota (budget)."""
    message: str | None = None
    retry_after: float | None = None
    limit_requests: int | None = None
    remaining_requests: int | None = None
    reset_requests: float | None = None
    limit_tokens: int | None = None
    remaining_tokens: int | None = None
    reset_tokens: float | None = None
    """None with limit_tokens set: the tightest token limit is a budget, which never resets."""
    reservation_id: str | None = None
    """The reservation to settle with the request's UsageRecord (None: nothing reserved)."""


class UsageRecord(Wire):
    """After a request: its tokens, added to the key's usage of the day and its token windows."""

    key_id: str
    model: str
    requests: int = Field(default=1, ge=0)
    prompt_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    output_tokens: int = Field(default=0, ge=0)
    batch_id: str | None = Field(default=None, min_length=1, max_length=32)
    """Set by the sender once per record and kept across its retries: the registry counts a
    batch id once (a retry after a reply that timed out, though the write committed, is a no-op).
    """
    reservation_id: str | None = Field(default=None, min_length=1, max_length=32)
    """The admission's reservation, which this record settles: its tokens give way to these."""


class UsageQuery(Wire):
    key_id: str | None = None
    model: str | None = None
    since: date | None = None
    until: date | None = None


class UsageRow(Wire):
    key_id: str
    key_name: str
    model: str
    day: date
    requests: int
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int


class UsageReport(Wire):
    rows: list[UsageRow]
