"""API-key auth (only when `settings.require_api_key` or a fixed `settings.api_key`, vLLM's
--api-key): `Authorization: Bearer <key>`, the fixed key or one verified by the registry, cached
for `gateway_key_cache_ttl` seconds so a request costs no bus round trip. Scopes: the management
API needs an admin key (403 otherwise); the verified key rides on the request for quota.py.

Revocation (or any change of a key) is an event, not a wait: every gateway listens to the
registry's key events and drops the key at once (`watch_keys`), and empties its cache when it
reconnects to NATS (events may have been missed meanwhile); the TTL only bounds what a lost
event could cost.
"""

from __future__ import annotations

import hashlib
import hmac
import time
from collections import OrderedDict

from aiohttp import web
from aiohttp.typedefs import Handler

from nats.aio.msg import Msg

from shoal.services.gateway.quota import API_KEY
from shoal.shared.bus.client import Bus
from shoal.shared.errors import Forbidden, Unauthorized
from shoal.shared.schemas.events import ApiKeyEvent
from shoal.shared.schemas.registry import ApiKeyScope, ApiKeyVerified

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/metrics/targets", "/openapi.json",
                          "/ping", "/", "/ui", "/docs"})
PUBLIC_PREFIXES = ("/ui/", "/docs/")
"""The dashboard's and the API docs' files: they hold no data (the pages call the API with the
user's key), so a browser can load them and then ask for a key."""
MAX_CACHED_KEYS = 10000


FIXED_KEY = ApiKeyVerified(valid=True, name="--api-key", scope=ApiKeyScope.ADMIN)
"""The fixed key (vLLM's --api-key) can do everything and has no limits or usage."""
ADMIN_PREFIXES = ("/api/v1/",)
"""The management API (and so the dashboard's data): admin keys only."""


class KeyCache:
    """secret hash -> (verification, until); bounded, so unknown keys cannot grow it without
    limit. `generation` changes with every forget, so a verify answered before a revocation
    event cannot put the key back afterwards."""

    def __init__(self, ttl: float) -> None:
        self.ttl = ttl
        self.generation = 0
        self._entries: OrderedDict[str, tuple[ApiKeyVerified, float]] = OrderedDict()

    @staticmethod
    def _key(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    def get(self, secret: str, now: float | None = None) -> ApiKeyVerified | None:
        entry = self._entries.get(self._key(secret))
        if entry is None or entry[1] < (time.monotonic() if now is None else now):
            return None
        return entry[0]

    def put(self, secret: str, verified: ApiKeyVerified, now: float | None = None,
            generation: int | None = None) -> None:
        if generation is not None and generation != self.generation:
            return  # a key event arrived while this was being verified: ask again next time
        key = self._key(secret)
        ttl = self.ttl if verified.expires_in is None else min(self.ttl, verified.expires_in)
        self._entries[key] = (verified, (time.monotonic() if now is None else now) + ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > MAX_CACHED_KEYS:
            self._entries.popitem(last=False)

    def forget(self, key_id: str) -> None:
        """Drop the key with this id (revoked, changed or deleted: the registry decides)."""
        self.generation += 1
        for key in [k for k, entry in self._entries.items() if entry[0].key_id == key_id]:
            del self._entries[key]

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()


async def watch_keys(bus: Bus, keys: KeyCache) -> object:
    """Subscribe this gateway (every gateway: a plain subscription, not a shared consumer) to
    the registry's key events, and clear the cache on every reconnection to NATS."""

    async def on_event(event: ApiKeyEvent, msg: Msg) -> None:
        keys.forget(event.id)

    bus.on_reconnect.append(keys.clear)
    return await bus.subscribe(bus.subjects.events_of("keys"), ApiKeyEvent, on_event)


def bearer(header: str | None) -> str:
    if not header:
        raise Unauthorized("missing API key: send `Authorization: Bearer <key>` "
                           "(create one with `shoal keys create NAME`)")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("malformed Authorization header: expected `Bearer <key>`")
    return secret.strip()


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Only when `require_api_key`: every route but the public ones needs a valid key."""
    from shoal.services.gateway.state import STATE  # the state module imports this one

    st = request.app[STATE]
    fixed = st.settings.api_key
    if (not (st.settings.require_api_key or fixed) or is_public(request.path)
            or request.method == "OPTIONS"):
        return await handler(request)
    secret = bearer(request.headers.get("Authorization"))
    if fixed and hmac.compare_digest(secret.encode(), fixed.encode()):
        verified = FIXED_KEY
    else:
        cached = st.keys.get(secret)
        if cached is None:
            generation = st.keys.generation
            cached = await st.registry.verify_key(secret)
            st.keys.put(secret, cached, generation=generation)
        verified = cached
    if not verified.valid:
        raise Unauthorized("invalid, expired or revoked API key")
    if request.path.startswith(ADMIN_PREFIXES) and verified.scope is not ApiKeyScope.ADMIN:
        raise Forbidden("this key is not allowed to manage the cluster: the management API "
                        "needs an admin key (`shoal keys create NAME --scope admin`)")
    request[API_KEY] = verified
    return await handler(request)
