"""BlockManager: prefix hits over chained hashes, the num_tokens - 1 cap, LRU eviction of
freed tails, reference counts, n > 1 sharing, collision checks and no leaks."""

from __future__ import annotations

from tests.unit.engine.engine_helpers import assert_pool_whole
from shoal.services.engine.core.block_manager import BlockManager
from shoal.services.engine.sampling_params import SamplingParams
from shoal.services.engine.core.sequence import Sequence

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0, index: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), SamplingParams(), index=index)


def compute(bm: BlockManager, seq: Sequence, cached: list | None = None) -> None:
    """Allocate and 'compute' the whole sequence, registering its full blocks."""
    hit = bm.find_cached_prefix(seq) if cached is None else cached
    assert bm.allocate_slots(seq, seq.num_tokens - len(hit) * BS, hit)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_full_blocks(seq)


def test_a_second_request_reuses_every_cached_leading_block():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(1, 11)))  # 10 tokens: 2 full blocks + 2
    compute(bm, a)
    b = make_seq(list(range(1, 9)) + [50, 51, 52], seq_id=1)  # shares the 2 full blocks
    hit = bm.find_cached_prefix(b)
    assert [blk.block_id for blk in hit] == a.block_ids[:2]
    assert bm.allocate_slots(b, b.num_tokens - 8, hit)
    assert b.num_computed_tokens == 8 and b.block_ids[:2] == a.block_ids[:2]
    assert b.block_ids[2] != a.block_ids[2]
    assert [bm.pool.blocks[i].ref_count for i in a.block_ids] == [2, 2, 1]
    assert bm.num_prefix_queries == 10 + 11 and bm.num_prefix_hits == 8
    assert_pool_whole(bm.pool, [a, b])
    bm.free(a)
    assert [bm.pool.blocks[i].ref_count for i in b.block_ids[:2]] == [1, 1]
    bm.free(b)
    assert_pool_whole(bm.pool)


def test_hit_is_capped_at_num_tokens_minus_one():
    bm = BlockManager(16, BS)
    a = make_seq(list(range(1, 9)))  # exactly two full blocks
    compute(bm, a)
    same = make_seq(list(range(1, 9)), seq_id=1)
    assert len(bm.find_cached_prefix(same)) == 1  # the last token must be recomputed
    longer = make_seq(list(range(1, 10)), seq_id=2)
    assert len(bm.find_cached_prefix(longer)) == 2
    bm.free(a)
    assert_pool_whole(bm.pool)


def test_hashes_chain_so_a_block_after_a_different_prefix_misses():
    bm = BlockManager(16, BS)
    a = make_seq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    b = make_seq([9, 9, 9, 9, 5, 6, 7, 8, 9], seq_id=1)  # same second block, other first
    assert bm.find_cached_prefix(b) == []
    bm.free(a)
    assert_pool_whole(bm.pool)


def test_a_hash_collision_is_not_a_hit():
    bm = BlockManager(16, BS, hash_fn=lambda parent, tokens: 1234)  # every block collides
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)
    assert bm.find_cached_prefix(make_seq([4, 3, 2, 1, 5], seq_id=1)) == []
    assert len(bm.find_cached_prefix(make_seq([1, 2, 3, 4, 7], seq_id=2))) == 1
    bm.free(a)
    assert_pool_whole(bm.pool)


def test_freed_tails_are_evicted_first():
    bm = BlockManager(4, BS)
    a = make_seq(list(range(1, 14)))  # 13 tokens: 3 full blocks + 1 -> all 4 blocks
    compute(bm, a)
    assert bm.num_free_blocks == 0
    table = list(a.block_ids)
    bm.free(a)  # in reverse: block 3 (partial), then 2, 1, 0
    other = make_seq([77] * 5, seq_id=1)  # needs 2 blocks: takes the two tail blocks
    compute(bm, other, cached=[])
    assert other.block_ids == [table[3], table[2]]
    again = make_seq(list(range(1, 14)), seq_id=2)
    assert len(bm.find_cached_prefix(again)) == 2  # the head of the prefix survived
    bm.free(other)
    assert_pool_whole(bm.pool)


def test_lru_prefers_the_prefix_used_longest_ago():
    bm = BlockManager(2, BS)
    a, b = make_seq([1, 2, 3, 4, 5]), make_seq([6, 7, 8, 9, 10], seq_id=1)
    compute(bm, a)
    bm.free(a)
    compute(bm, b)  # no room left but a's freed blocks: a's cached block is evicted
    bm.free(b)
    assert bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], seq_id=2)) == []
    assert len(bm.find_cached_prefix(make_seq([6, 7, 8, 9, 10], seq_id=3))) == 1
    assert_pool_whole(bm.pool)


def test_touching_a_hit_refreshes_it():
    bm = BlockManager(3, BS)
    a = make_seq([1, 2, 3, 4, 5])
    compute(bm, a)  # blocks 0 (cached), 1
    bm.free(a)  # free order: 1, 0
    c = make_seq([1, 2, 3, 4, 6], seq_id=1)
    compute(bm, c)  # hits block 0 (revived), takes block 2 (never used) for its tail
    bm.free(c)  # free order now: 1, 2, 0 -> block 0 is the most recently used
    d = make_seq([9] * 8, seq_id=2)
    compute(bm, d, cached=[])  # takes 1 and 2
    assert sorted(d.block_ids) == [1, 2]
    assert len(bm.find_cached_prefix(make_seq([1, 2, 3, 4, 5], seq_id=3))) == 1
    bm.free(d)
    assert_pool_whole(bm.pool)


def test_allocate_slots_refuses_without_side_effects_when_short():
    bm = BlockManager(3, BS)
    a = make_seq(list(range(1, 10)))  # 9 tokens -> 3 blocks
    compute(bm, a)
    bm.free(a)
    b = make_seq(list(range(1, 9)) + [99] * 8, seq_id=1)  # hits 2 blocks, needs 2 more
    hit = bm.find_cached_prefix(b)
    assert len(hit) == 2
    queries = bm.num_prefix_queries
    assert not bm.allocate_slots(b, b.num_tokens - 8, hit)  # 3 free - 2 revived < 2 new
    assert b.block_ids == [] and b.num_computed_tokens == 0
    assert bm.num_prefix_queries == queries
    assert_pool_whole(bm.pool)
    assert bm.allocate_slots(b, 4, hit)  # a shorter chunk fits
    assert len(b.block_ids) == 3
    assert not bm.allocate_slots(b, 4 + 1, None)  # the next chunk needs a 4th block
    assert len(b.block_ids) == 3
    bm.free(b)
    assert_pool_whole(bm.pool)


def test_n_children_share_the_prompt_blocks():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    prompt = list(range(1, 12))  # 11 tokens: 2 full blocks + 3
    first = make_seq(prompt)
    compute(bm, first, cached=[])
    children = [make_seq(prompt, seq_id=i, index=i) for i in (1, 2, 3)]
    for child in children:
        shared = bm.shared_prefix(child, first)
        assert bm.allocate_slots(child, child.num_tokens - len(shared) * BS, shared)
        assert child.block_ids[:2] == first.block_ids[:2]
        assert child.block_ids[2] != first.block_ids[2]
    assert [bm.pool.blocks[i].ref_count for i in first.block_ids] == [4, 4, 1]
    assert_pool_whole(bm.pool, [first, *children])
    for seq in [first, *children]:
        bm.free(seq)
    assert_pool_whole(bm.pool)


def test_prefix_caching_off_never_hits():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    a = make_seq(list(range(1, 10)))
    compute(bm, a, cached=[])
    assert bm.find_cached_prefix(make_seq(list(range(1, 10)), seq_id=1)) == []
    assert bm.pool.cached == {}
    bm.free(a)
    assert_pool_whole(bm.pool)
