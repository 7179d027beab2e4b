"""Error mapping: ShoalError kinds keep their status and OpenAI shape, aiohttp HTTP errors get the
same shape, anything unexpected is a bare 500 with no internals; API-key parsing and caching."""

from __future__ import annotations

import pytest
from aiohttp import web

from shoal.services.gateway.auth.keys import KeyCache, bearer, verify
from shoal.shared.schemas.registry import ApiKeyVerified
from shoal.services.gateway.errors import error_body
from shoal.shared.errors import (
    Conflict, InvalidRequest, NotFound, Overloaded, PayloadTooLarge, ShoalError, Timeout,
    Unauthorized, Unavailable,
)


@pytest.mark.parametrize("exc, status, kind", [
    (InvalidRequest("bad", param="n"), 400, "invalid_request_error"),
    (Unauthorized("no key"), 401, "authentication_error"),
    (NotFound("no model", code="model_not_found"), 404, "not_found_error"),
    (Conflict("stale"), 409, "conflict_error"),
    (Overloaded("full"), 429, "rate_limit_error"),
    (Unavailable("down"), 503, "service_unavailable"),
    (Timeout("slow"), 503, "timeout_error"),
    (PayloadTooLarge("big"), 413, "invalid_request_error"),
])
def test_shoal_errors_keep_status_and_shape(exc: ShoalError, status: int, kind: str) -> None:
    got_status, body = error_body(exc)
    assert got_status == status and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == kind and body["error"]["message"] == exc.message


def test_engine_error_bodies_come_back_as_the_right_kind() -> None:
    err = ShoalError.from_dict({"message": "prompt too long", "type": "invalid_request_error",
                                "param": "prompt"},
                               status=400)
    assert error_body(err) == (400,
                               {"error": {"message": "prompt too long",
                                          "type": "invalid_request_error",
                                               "param": "prompt", "code": "invalid_request"}})
    assert error_body(ShoalError.from_dict({"message": "gone", "type": ""}, status=503))[0] == 503
    big = ShoalError.from_dict(PayloadTooLarge("the answer is 9 MB").to_dict(), status=413)
    assert isinstance(big, PayloadTooLarge) and error_body(big)[0] == 413  # the status decides
    late = ShoalError.from_dict(Timeout("no reply").to_dict(), status=503)
    assert isinstance(late, Timeout) and error_body(late)[1]["error"]["type"] == "timeout_error"


def test_http_errors_and_unexpected_ones() -> None:
    assert error_body(web.HTTPNotFound())[1]["error"]["type"] == "not_found_error"
    assert error_body(web.HTTPMethodNotAllowed("POST", ["GET"]))[0] == 405
    status, body = error_body(KeyError("secret internals"))
    assert status == 500 and "secret" not in str(body)


def test_bearer_parsing() -> None:
    assert bearer("Bearer sk-1") == "sk-1" and bearer("bearer  sk-2 ") == "sk-2"
    for bad in (None, "", "Basic abc", "Bearer "):
        with pytest.raises(Unauthorized):
            bearer(bad)


def test_key_cache_expires_and_is_bounded() -> None:
    cache = KeyCache(ttl=10)
    good, bad = ApiKeyVerified(valid=True, key_id="a"), ApiKeyVerified(valid=False)
    cache.put("k", good, now=0)
    assert cache.get("k", now=5) is good and cache.get("k", now=11) is None
    assert cache.get("other", now=0) is None
    cache.put("bad", bad, now=0)
    assert cache.get("bad", now=1) is bad


def test_refusals_never_evict_a_valid_key() -> None:
    """Issue 24: 10,001 made-up tokens evicted every valid key from the shared 10,000-entry
    cache. Refusals are kept apart, bounded on their own, and never served stale."""
    from shoal.services.gateway.auth.keys import MAX_CACHED_KEYS, MAX_REFUSED_KEYS

    cache = KeyCache(ttl=10, stale_max=600)
    good = ApiKeyVerified(valid=True, key_id="a")
    cache.put("sk-good", good, now=0)
    refused = ApiKeyVerified(valid=False)
    for i in range(MAX_CACHED_KEYS + 1):
        cache.put(f"sk-shoal-made-up-{i}", refused, now=1)
    assert cache.get("sk-good", now=2) is good
    assert cache.last_verified("sk-good", now=100) is good  # the registry away: still served
    assert len(cache._refused) == MAX_REFUSED_KEYS  # bounded on their own
    assert cache.get(f"sk-shoal-made-up-{MAX_CACHED_KEYS}", now=2) is refused  # the latest
    assert cache.last_verified(f"sk-shoal-made-up-{MAX_CACHED_KEYS}", now=2) is None
    cache.put("sk-good", ApiKeyVerified(valid=False, key_id="a"), now=3)  # revoked since
    assert cache.last_verified("sk-good", now=4) is None


def test_key_cache_forgets_a_revoked_key_at_once() -> None:
    cache = KeyCache(ttl=3600)
    a, b = ApiKeyVerified(valid=True, key_id="a"), ApiKeyVerified(valid=True, key_id="b")
    cache.put("sk-a", a, now=0)
    cache.put("sk-b", b, now=0)
    cache.forget("a")  # the registry's event for key a
    assert cache.get("sk-a", now=1) is None and cache.get("sk-b", now=1) is b
    generation = cache.generation  # a verify of sk-a was answered before the event...
    cache.forget("a")
    cache.put("sk-a", a, now=1, generation=generation)  # ...so it is not cached
    assert cache.get("sk-a", now=2) is None
    cache.clear()  # reconnected to NATS: events may have been missed
    assert cache.get("sk-b", now=2) is None


def test_key_cache_keeps_a_key_no_longer_than_it_is_valid() -> None:
    cache = KeyCache(ttl=10)
    cache.put("sk-soon", ApiKeyVerified(valid=True, key_id="s", expires_in=2.0), now=0)
    assert cache.get("sk-soon", now=1.5) is not None and cache.get("sk-soon", now=2.5) is None


def test_key_cache_serves_the_last_verification_only_within_its_bound() -> None:
    cache = KeyCache(ttl=10, stale_max=600)
    key = ApiKeyVerified(valid=True, key_id="a")
    cache.put("sk-a", key, now=0)
    assert cache.get("sk-a", now=11) is None  # stale: ask the registry first...
    assert cache.last_verified("sk-a", now=11) is key  # ...and use this only if it cannot answer
    assert cache.last_verified("sk-a", now=601) is None
    assert cache.last_verified("sk-unknown", now=1) is None
    cache.put("sk-soon", ApiKeyVerified(valid=True, key_id="s", expires_in=30.0), now=0)
    assert cache.last_verified("sk-soon", now=29) is not None
    assert cache.last_verified("sk-soon", now=31) is None  # never past the key's expiry
    cache.forget("a")  # a revocation event applies to stale entries too
    assert cache.last_verified("sk-a", now=11) is None
    assert KeyCache(ttl=10, stale_max=0).stale_max == 10  # 0: no more than the TTL


class _Registry:
    """Answers verify_key with `answer` (or raises it)."""

    def __init__(self, answer: ApiKeyVerified | Exception) -> None:
        self.answer = answer

    async def verify_key(self, secret: str) -> ApiKeyVerified:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


async def test_verify_falls_back_to_the_last_verification_only_on_a_503() -> None:
    cache = KeyCache(ttl=0.0, stale_max=600)
    key = ApiKeyVerified(valid=True, key_id="a")
    assert await verify(cache, _Registry(key), "sk-a") is key  # type: ignore[arg-type]
    for away in (Unavailable("database away"), Timeout("no answer")):
        assert await verify(cache, _Registry(away), "sk-a") is key  # type: ignore[arg-type]
        with pytest.raises(type(away)):  # a key never verified here is still refused
            await verify(cache, _Registry(away), "sk-new")  # type: ignore[arg-type]
    revoked = ApiKeyVerified(valid=False)
    assert await verify(cache, _Registry(revoked), "sk-a") is revoked  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest):  # other errors are not papered over
        await verify(cache, _Registry(InvalidRequest("bad")), "sk-b")  # type: ignore[arg-type]
