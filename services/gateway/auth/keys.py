"""API-key auth: `Authorization: Bearer <key>` (or Anthropic's `x-api-key: <key>`), the fixed
key (vLLM's --api-key) or one verified by the registry, cached for `gateway_key_cache_ttl`
seconds so a request costs no bus round trip. Scopes: the management API needs an admin key
(403 otherwise); the verified key rides on the request for quota.py (limits, usage).

A key that is presented is always honoured; keys are required only with
`settings.require_api_key` or a fixed `settings.api_key`. On an open gateway a request without
a key is served in full (vLLM without --api-key), but one that presents a Shoal key
(`Bearer sk-shoal-...`) gets exactly that key: 401 if it is unknown, revoked or expired, its
scope, its limits, its usage. A bearer token that cannot be a Shoal key there (the placeholder
OpenAI clients must send, such as vLLM's `EMPTY`) is no key, as vLLM treats it.

Revocation (or any change of a key) is an event, not a wait: every gateway listens to the
registry's key events and drops the key at once (`watch_keys`), and empties its cache when it
reconnects to NATS (events may have been missed meanwhile); the TTL only bounds what a lost
event could cost.

While the registry cannot verify (Postgres or the registry away: a 503), a key verified within
`gateway_key_stale_max` seconds is served from that last verification, so chat with keys
outlives a database outage: revocation events still drop it at once, a key never outlives its
own expiry, and a key this gateway never verified is still refused (the 503).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time
from collections import OrderedDict
from typing import Any

from aiohttp import web
from aiohttp.typedefs import Handler

from nats.aio.msg import Msg

from shoal.services.gateway.auth.quota import API_KEY
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.bus.gather import answer
from shoal.shared.config import Settings
from shoal.shared.errors import Forbidden, Timeout, Unauthorized, Unavailable
from shoal.shared.schemas.events import ApiKeyEvent
from shoal.shared.schemas.gateway import GatewayInfo
from shoal.shared.schemas.registry import SECRET_PREFIX, ApiKeyScope, ApiKeyVerified

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/metrics/targets", "/openapi.json",
                          "/ping", "/", "/ui", "/docs"})
PUBLIC_PREFIXES = ("/ui/", "/docs/")
"""The dashboard's and the API docs' files: they hold no data (the pages call the API with the
user's key), so a browser can load them and then ask for a key."""
MAX_CACHED_KEYS = 10000
"""Valid keys one gateway remembers (each is asked about again after the TTL)."""
MAX_REFUSED_KEYS = 1024
"""Refused tokens one gateway remembers, apart from valid keys: a client retrying with a bad
key costs no registry call per request, and no number of made-up tokens evicts a valid key."""
log = logging.getLogger(__name__)


REFUSED = ApiKeyVerified(valid=False)
FIXED_KEY = ApiKeyVerified(valid=True, name="--api-key", scope=ApiKeyScope.ADMIN)
"""The fixed key (vLLM's --api-key) can do everything and has no limits or usage."""
ADMIN_PREFIXES = ("/api/v1/", "/v1/load_lora_adapter", "/v1/unload_lora_adapter")
"""The management API (and so the dashboard's data) and vLLM's runtime LoRA endpoints (they
change what the cluster serves): admin keys only."""


class KeyCache:
    """secret hash -> (verification, fresh until, usable until), in two bounded LRUs: valid keys
    (MAX_CACHED_KEYS) and refusals (MAX_REFUSED_KEYS, fresh for `ttl` only). Kept apart, so a
    flood of made-up tokens only evicts other refusals, never a valid key that must outlive a
    registry outage. `generation` changes with every forget, so a verify answered before a
    revocation event cannot put the key back afterwards.

    A valid entry is fresh for `ttl` seconds (served without asking); after that it is asked
    again, and only while the registry cannot answer is it served stale, up to `stale_max`
    seconds after its verification (never past the key's own expiry). A refusal is never
    served stale: once past `ttl`, an unknown token is asked about again (503 while the registry
    is away)."""

    def __init__(self, ttl: float, stale_max: float = 0.0) -> None:
        self.ttl = ttl
        self.stale_max = max(ttl, stale_max)
        self.generation = 0
        self.stale_since: float | None = None
        """When keys began to be served stale (the registry unable to verify), for the log."""
        self._entries: OrderedDict[str, tuple[ApiKeyVerified, float, float]] = OrderedDict()
        self._refused: OrderedDict[str, tuple[ApiKeyVerified, float]] = OrderedDict()

    @staticmethod
    def _key(secret: str) -> str:
        return hashlib.sha256(secret.encode()).hexdigest()

    def get(self, secret: str, now: float | None = None) -> ApiKeyVerified | None:
        """The verification (valid or not) while it is fresh, else None (ask the registry)."""
        key = self._key(secret)
        now = time.monotonic() if now is None else now
        entry = self._entries.get(key)
        if entry is not None and entry[1] >= now:
            return entry[0]
        refused = self._refused.get(key)
        if refused is not None and refused[1] >= now:
            return refused[0]
        return None

    def last_verified(self, secret: str, now: float | None = None) -> ApiKeyVerified | None:
        """The last valid verification within `stale_max` (for when the registry cannot
        answer)."""
        entry = self._entries.get(self._key(secret))
        if entry is None or entry[2] < (time.monotonic() if now is None else now):
            return None
        return entry[0]

    def put(self, secret: str, verified: ApiKeyVerified, now: float | None = None,
            generation: int | None = None) -> None:
        if generation is not None and generation != self.generation:
            return  # a key event arrived while this was being verified: ask again next time
        key = self._key(secret)
        now = time.monotonic() if now is None else now
        if not verified.valid:
            self._entries.pop(key, None)
            _bounded_put(self._refused, key, (verified, now + self.ttl), MAX_REFUSED_KEYS)
            return
        self._refused.pop(key, None)
        lives = float("inf") if verified.expires_in is None else verified.expires_in
        _bounded_put(self._entries, key, (verified, now + min(self.ttl, lives),
                                          now + min(self.stale_max, lives)), MAX_CACHED_KEYS)

    def forget(self, key_id: str) -> None:
        """Drop the key with this id (revoked, changed or deleted: the registry decides)."""
        self.generation += 1
        for entries in (self._entries, self._refused):
            for key in [k for k, entry in entries.items() if entry[0].key_id == key_id]:
                del entries[key]

    def clear(self) -> None:
        self.generation += 1
        self._entries.clear()
        self._refused.clear()


def _bounded_put(entries: OrderedDict[str, Any], key: str, value: Any, bound: int) -> None:
    """Insert as the most recent entry; drop the least recent beyond `bound`."""
    entries[key] = value
    entries.move_to_end(key)
    while len(entries) > bound:
        entries.popitem(last=False)


async def verify(keys: KeyCache, registry: RegistryClient, secret: str) -> ApiKeyVerified:
    """The key's verification: cached while fresh, else the registry's; while the registry
    cannot answer (503), the last verification within the cache's `stale_max`."""
    cached = keys.get(secret)
    if cached is not None:
        return cached
    generation = keys.generation
    try:
        verified = await registry.verify_key(secret)
    except (Unavailable, Timeout) as exc:
        stale = keys.last_verified(secret)
        if stale is None:
            raise
        if keys.stale_since is None:
            keys.stale_since = time.monotonic()
            log.warning("cannot verify API keys now (%s): serving keys verified in the last "
                        "%.0fs from their last verification", exc.message, keys.stale_max)
        return stale
    if keys.stale_since is not None:
        log.info("API keys are verified again (after %.0fs)", time.monotonic() - keys.stale_since)
        keys.stale_since = None
    keys.put(secret, verified, generation=generation)
    return verified


async def watch_keys(bus: Bus, keys: KeyCache) -> object:
    """Subscribe this gateway (every gateway: a plain subscription, not a shared consumer) to
    the registry's key events, and clear the cache on every reconnection to NATS."""

    async def on_event(event: ApiKeyEvent, msg: Msg) -> None:
        keys.forget(event.id)

    bus.on_reconnect.append(keys.clear)
    return await bus.subscribe(bus.subjects.events_of("keys"), ApiKeyEvent, on_event)


def keys_required(settings: Settings) -> bool:
    """Keys are required with SHOAL_REQUIRE_API_KEY, or with a fixed key (vLLM's --api-key)."""
    return settings.require_api_key or bool(settings.api_key)


async def answer_gateway_info(bus: Bus, settings: Settings, address: str) -> object:
    """Tell whoever asks (`shoal keys create`) whether this gateway requires keys."""
    info = GatewayInfo(address=address, keys_required=keys_required(settings))
    return await answer(bus, bus.subjects.gateway_info, info)


def bearer(header: str | None) -> str:
    if not header:
        raise Unauthorized("missing API key: send `Authorization: Bearer <key>` or "
                           "`x-api-key: <key>` (create one with `shoal keys create NAME`)")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("malformed Authorization header: expected `Bearer <key>`")
    return secret.strip()


def presented_key(header: str | None) -> str | None:
    """The Shoal key a request presents where none is required (`Bearer sk-shoal-...`); None for
    no header, another scheme, or a token that cannot be a Shoal key (a placeholder)."""
    if not header:
        return None
    scheme, _, secret = header.partition(" ")
    secret = secret.strip()
    return secret if scheme.lower() == "bearer" and secret.startswith(SECRET_PREFIX) else None


def is_public(path: str) -> bool:
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIXES)


async def _verification(settings: Settings, keys: KeyCache, registry: RegistryClient,
                        secret: str) -> ApiKeyVerified:
    fixed = settings.api_key
    if fixed and hmac.compare_digest(secret.encode(), fixed.encode()):
        return FIXED_KEY
    if not secret.startswith(SECRET_PREFIX):
        return REFUSED  # no key the registry makes looks like this: nothing to ask
    return await verify(keys, registry, secret)


@web.middleware
async def auth_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every route but the public ones: the key presented (module docstring), required or not."""
    from shoal.services.gateway.state import STATE  # the state module imports this one

    st = request.app[STATE]
    if is_public(request.path) or request.method == "OPTIONS":
        return await handler(request)
    required = keys_required(st.settings)
    header = request.headers.get("Authorization")
    if header is None and (api_key := request.headers.get("x-api-key")):
        header = f"Bearer {api_key}"  # Anthropic's header: the same keys
    secret = bearer(header) if required else presented_key(header)
    if secret is None:  # an open gateway and no key: served in full
        return await handler(request)
    verified = await _verification(st.settings, st.keys, st.registry, secret)
    if not verified.valid:
        raise Unauthorized("invalid, expired or revoked API key" + (
            "" if required else " (this gateway does not require keys: a key that is sent "
            "must be valid; send none to be served without one)"))
    if request.path.startswith(ADMIN_PREFIXES) and verified.scope is not ApiKeyScope.ADMIN:
        raise Forbidden("this key is not allowed to manage the cluster: the management API "
                        "needs an admin key (`shoal keys create NAME --scope admin`)")
    request[API_KEY] = verified
    return await handler(request)
