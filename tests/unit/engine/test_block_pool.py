"""BlockPool: LRU free list, reference counts, the hash index and its collision checks."""

from __future__ import annotations

import pytest

from tests.unit.engine.engine_helpers import assert_pool_whole
from shoal.services.engine.core.block_pool import BlockPool, hash_block_tokens


def test_allocates_in_order_then_refuses_when_empty():
    pool = BlockPool(3)
    ids = [pool.allocate().block_id for _ in range(3)]
    assert ids == [0, 1, 2]
    assert pool.num_free == 0 and pool.usage == 1.0
    with pytest.raises(RuntimeError):
        pool.allocate()
    for i in ids:
        pool.free(pool.blocks[i])
    assert_pool_whole(pool)


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    for i in (2, 0, 3, 1):
        pool.free(blocks[i])
    assert [pool.allocate().block_id for _ in range(4)] == [2, 0, 3, 1]
    for b in blocks:
        pool.free(b)
    assert_pool_whole(pool)


def test_ref_counts_keep_a_shared_block_out_of_the_free_list():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.touch(block)
    assert block.ref_count == 2
    pool.free(block)
    assert block.block_id not in pool.free_blocks and pool.usage == 0.5
    pool.free(block)
    assert block.block_id in pool.free_blocks and pool.usage == 0.0
    with pytest.raises(AssertionError):
        pool.free(block)
    assert_pool_whole(pool)


def test_a_freed_cached_block_stays_findable_until_reallocated():
    pool = BlockPool(2)
    block = pool.allocate()
    h = hash_block_tokens(None, [1, 2, 3])
    pool.register(block, h, None, [1, 2, 3])
    pool.free(block)
    assert pool.lookup(h, None, [1, 2, 3]) is block
    pool.touch(block)  # revived from the middle of the free list
    assert block.ref_count == 1 and block.block_id not in pool.free_blocks
    pool.free(block)
    other = pool.allocate()  # block 1 was freed earlier (never used): taken first
    assert other.block_id == 1 and pool.lookup(h, None, [1, 2, 3]) is block
    again = pool.allocate()  # now the cached block is evicted
    assert again is block and block.block_hash is None
    assert pool.lookup(h, None, [1, 2, 3]) is None
    pool.free(other)
    pool.free(again)
    assert_pool_whole(pool)


def test_lookup_checks_tokens_and_parent_against_collisions():
    pool = BlockPool(2)
    block = pool.allocate()
    pool.register(block, 42, 7, [1, 2])
    assert pool.lookup(42, 7, [1, 2]) is block
    assert pool.lookup(42, 7, [1, 3]) is None  # same hash, other tokens
    assert pool.lookup(42, 8, [1, 2]) is None  # same hash, other prefix
    assert pool.lookup(43, 7, [1, 2]) is None
    pool.free(block)
    assert_pool_whole(pool)


def test_a_second_copy_of_a_prefix_does_not_replace_the_cached_one():
    pool = BlockPool(2)
    first, second = pool.allocate(), pool.allocate()
    pool.register(first, 5, None, [9])
    pool.register(second, 5, None, [9])
    assert pool.cached[5] is first and second.block_hash is None
    pool.free(second)
    pool.free(first)
    assert pool.allocate() is second  # evicting the copy leaves the cached block findable
    assert pool.lookup(5, None, [9]) is first
    pool.free(second)
    assert_pool_whole(pool)


def test_hash_covers_the_whole_prefix():
    a = hash_block_tokens(None, [1, 2])
    b = hash_block_tokens(None, [1, 3])
    assert hash_block_tokens(a, [5, 6]) != hash_block_tokens(b, [5, 6])
    assert hash_block_tokens(a, [5, 6]) == hash_block_tokens(a, [5, 6])
    assert hash_block_tokens(None, [5, 6]) != hash_block_tokens(a, [5, 6])
