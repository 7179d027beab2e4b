"""Routing policy (pure): least outstanding requests among live instances, with prefix affinity.

A prompt is cut into fixed-size chunks whose hashes chain (like KV blocks), so two requests that
share a long prefix share leading hashes; the instance that served a prefix most recently likely
still caches it, and gets the request unless it is clearly busier than the least loaded one.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

PREFIX_CHUNK_CHARS = 256
"""Characters per hashed chunk of a text prompt (about 64 tokens)."""
PREFIX_CHUNK_TOKENS = 64
MAX_PREFIX_CHUNKS = 32
AFFINITY_SLACK = 4
"""An affine instance is chosen while it has at most this many more outstanding requests."""
MAX_AFFINITY_ENTRIES = 65536


@dataclass(slots=True)
class Candidate:
    """One live instance as the router sees it."""

    instance_id: str
    num_outstanding: int
    """Requests this gateway has in flight there."""
    num_queued: int = 0
    """Engine-reported running + waiting (covers other gateways' requests)."""
    kv_cache_usage: float = 0.0


def _chain(chunks: Iterable[bytes]) -> list[bytes]:
    hashes: list[bytes] = []
    parent = b""
    for chunk in chunks:
        parent = hashlib.blake2b(parent + chunk, digest_size=8).digest()
        hashes.append(parent)
        if len(hashes) >= MAX_PREFIX_CHUNKS:
            break
    return hashes


def text_prefix_hashes(text: str, chunk_chars: int = PREFIX_CHUNK_CHARS) -> list[bytes]:
    """Chained hashes of the full `chunk_chars` chunks of `text` (a partial tail is not hashed)."""
    num_full = len(text) // chunk_chars
    return _chain(text[i * chunk_chars:(i + 1) * chunk_chars].encode("utf-8", "surrogatepass")
                  for i in range(num_full))


def token_prefix_hashes(token_ids: Sequence[int],
                        chunk_tokens: int = PREFIX_CHUNK_TOKENS) -> list[bytes]:
    num_full = len(token_ids) // chunk_tokens
    return _chain(",".join(map(str, token_ids[i * chunk_tokens:(i + 1) * chunk_tokens])).encode()
                  for i in range(num_full))


def messages_prefix_hashes(messages: Sequence[tuple[str, str]]) -> list[bytes]:
    """Chat: the conversation flattened as role/content records, then hashed like text."""
    return text_prefix_hashes("".join(f"\x1e{role}\x1f{content}" for role, content in messages))


def lora_prefix_hashes(hashes: Sequence[bytes], lora: str | None) -> list[bytes]:
    """A LoRA adapter's request: its own hash first (so routing prefers the instance that last
    served the adapter, which has it loaded, even for a short prompt), then the prompt's hashes
    salted with it (an adapter's KV blocks serve only that adapter in the engine)."""
    if lora is None:
        return list(hashes)
    root = hashlib.blake2b(b"lora\0" + lora.encode(), digest_size=8).digest()
    return [root, *(hashlib.blake2b(root + h, digest_size=8).digest() for h in hashes)]


class PrefixAffinity:
    """Bounded LRU map from prefix hash to the instance that last served it."""

    def __init__(self, max_entries: int = MAX_AFFINITY_ENTRIES) -> None:
        self._owner: OrderedDict[bytes, str] = OrderedDict()
        self._max_entries = max_entries

    def __len__(self) -> int:
        return len(self._owner)

    def record(self, hashes: Sequence[bytes], instance_id: str) -> None:
        for h in hashes:
            self._owner[h] = instance_id
            self._owner.move_to_end(h)
        while len(self._owner) > self._max_entries:
            self._owner.popitem(last=False)

    def match(self, hashes: Sequence[bytes], instance_ids: set[str]) -> tuple[str, int] | None:
        """The instance (among `instance_ids`) owning the longest matching prefix, and its depth."""
        for depth in range(len(hashes), 0, -1):
            owner = self._owner.get(hashes[depth - 1])
            if owner is not None and owner in instance_ids:
                return owner, depth
        return None

    def forget(self, instance_id: str) -> None:
        for h in [h for h, owner in self._owner.items() if owner == instance_id]:
            del self._owner[h]


def _load_key(c: Candidate) -> tuple[int, int, float]:
    return c.num_outstanding, c.num_queued, c.kv_cache_usage


class Router:
    """Chooses an instance; `tick` rotates ties so equal instances share work evenly."""

    def __init__(self, affinity: PrefixAffinity | None = None, slack: int = AFFINITY_SLACK) -> None:
        self.affinity = affinity or PrefixAffinity()
        self.slack = slack
        self._tick = 0

    def choose(self, candidates: Sequence[Candidate], hashes: Sequence[bytes] = (),
               exclude: Iterable[str] = ()) -> str | None:
        """The instance for a request with these prefix hashes, or None when none is left."""
        excluded = set(exclude)
        pool = [c for c in candidates if c.instance_id not in excluded]
        if not pool:
            return None
        least = min(_load_key(c) for c in pool)
        if hashes:
            found = self.affinity.match(hashes, {c.instance_id for c in pool})
            if found is not None:
                owner = next(c for c in pool if c.instance_id == found[0])
                if owner.num_outstanding <= least[0] + self.slack:
                    return owner.instance_id
        tied = sorted((c for c in pool if _load_key(c) == least), key=lambda c: c.instance_id)
        self._tick += 1
        return tied[self._tick % len(tied)].instance_id

    def record(self, hashes: Sequence[bytes], instance_id: str) -> None:
        """Remember that `instance_id` now caches this prefix."""
        if hashes:
            self.affinity.record(hashes, instance_id)
