"""OpenAI's rate-limit headers from a quota grant (pure).

`x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, with resets written as OpenAI writes
them ("1s", "6m0s", "20ms"); only the kinds of limit the key has are sent. The tokens' are the
tightest of the key's tpm and token_budget; a budget never resets, so it has no reset header.
"""

from __future__ import annotations

from shoal.shared.errors import RateLimited
from shoal.shared.schemas.registry import QuotaGrant


def duration(seconds: float) -> str:
    if seconds < 1:
        return f"{max(0, round(seconds * 1000))}ms"
    minutes, rest = divmod(round(seconds), 60)
    return f"{minutes}m{rest}s" if minutes else f"{rest}s"


def ratelimit_headers(grant: QuotaGrant) -> dict[str, str]:
    headers: dict[str, str] = {}
    for kind in ("requests", "tokens"):
        limit = getattr(grant, f"limit_{kind}")
        if limit is None:
            continue
        headers[f"x-ratelimit-limit-{kind}"] = str(limit)
        headers[f"x-ratelimit-remaining-{kind}"] = str(getattr(grant, f"remaining_{kind}"))
        reset = getattr(grant, f"reset_{kind}")
        if reset is not None:
            headers[f"x-ratelimit-reset-{kind}"] = duration(reset)
    return headers


def refusal(grant: QuotaGrant) -> RateLimited:
    """The 429 for a refused grant: OpenAI's shapes (type "requests"/"tokens" with code
    rate_limit_exceeded; a spent budget: insufficient_quota, no Retry-After: waiting will not
    help)."""
    message = grant.message or "rate limit exceeded"
    if grant.code == "insufficient_quota":
        return RateLimited(message, code="insufficient_quota", kind="insufficient_quota",
                           headers=ratelimit_headers(grant))
    kind = "requests" if grant.remaining_requests == 0 else "tokens"
    return RateLimited(message, code="rate_limit_exceeded", kind=kind,
                       retry_after=grant.retry_after, headers=ratelimit_headers(grant))
