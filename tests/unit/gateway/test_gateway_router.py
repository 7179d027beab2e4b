"""Routing policy: least outstanding, ties rotated, prefix affinity with a load slack, exclusion."""

from __future__ import annotations

from collections import Counter

from shoal.services.gateway.routing.router import (
    Candidate, PrefixAffinity, Router, messages_prefix_hashes, text_prefix_hashes,
    token_prefix_hashes,
)


def test_least_outstanding_wins() -> None:
    router = Router()
    pool = [Candidate("a", 5), Candidate("b", 1), Candidate("c", 3)]
    assert router.choose(pool) == "b"


def test_engine_queue_breaks_ties_then_rotation_spreads_work() -> None:
    router = Router()
    assert router.choose([Candidate("a", 0, num_queued=4), Candidate("b", 0, num_queued=1)]) == "b"
    picks = Counter(router.choose([Candidate("a", 0), Candidate("b", 0)]) for _ in range(10))
    assert picks == {"a": 5, "b": 5}


def test_exclusion_and_empty_pool() -> None:
    router = Router()
    assert router.choose([Candidate("a", 0)], exclude=["a"]) is None
    assert router.choose([]) is None
    assert router.choose([Candidate("a", 0), Candidate("b", 9)], exclude=["a"]) == "b"


def test_prefix_hashes_chain_and_share_leading_chunks() -> None:
    base = "x" * 1000
    a, b = text_prefix_hashes(base + "tail one"), text_prefix_hashes(base + "other tail")
    assert len(a) == 1000 // 256 and a == b
    assert text_prefix_hashes("short") == []
    c = text_prefix_hashes("y" + base[1:])
    assert c[0] != a[0] and c[1] != a[1]  # chained: a different first chunk changes every hash
    assert token_prefix_hashes(list(range(130)))[:2] == token_prefix_hashes(list(range(128)) + [7,
                                                                                                7])[:2]
    m1 = messages_prefix_hashes([("system", "s" * 600), ("user", "q1")])
    m2 = messages_prefix_hashes([("system", "s" * 600), ("user", "q2")])
    assert m1 and m1 == m2[:len(m1)]


def test_affinity_routes_shared_prefix_to_the_same_instance() -> None:
    router = Router()
    hashes = text_prefix_hashes("p" * 2048)
    router.record(hashes, "b")
    pool = [Candidate("a", 0), Candidate("b", 2)]
    assert router.choose(pool, hashes) == "b"
    assert router.choose(pool, hashes[:3]) == "b"  # a shorter shared prefix still matches
    assert router.choose(pool, text_prefix_hashes("q" * 2048)) == "a"


def test_affinity_gives_way_when_the_owner_is_much_busier() -> None:
    router = Router(slack=4)
    hashes = text_prefix_hashes("p" * 1024)
    router.record(hashes, "b")
    assert router.choose([Candidate("a", 0), Candidate("b", 4)], hashes) == "b"
    assert router.choose([Candidate("a", 0), Candidate("b", 5)], hashes) == "a"
    assert router.choose([Candidate("a", 0), Candidate("b", 0)], hashes, exclude=["b"]) == "a"


def test_affinity_prefers_longest_match_is_bounded_and_forgets() -> None:
    aff = PrefixAffinity(max_entries=8)
    long = text_prefix_hashes("z" * 256 * 6)
    aff.record(long[:2], "a")
    aff.record(long, "b")
    assert aff.match(long, {"a", "b"}) == ("b", 6)
    assert aff.match(long, {"a"}) is None  # b overwrote the shared chunks
    for i in range(20):
        aff.record(text_prefix_hashes(str(i) * 256), "c")
    assert len(aff) == 8
    aff.forget("c")
    assert len(aff) < 8
