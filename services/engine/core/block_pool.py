"""BlockPool: the preallocated KV blocks, their reference counts, the prefix-cache index
(hash -> block) and an O(1) LRU free list. Pure bookkeeping: no tensors, no sequences.

A freed block keeps its hash and stays findable until it is handed out again, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

HashFn = Callable[[int | None, Sequence[int]], int]


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """xxh64 of the parent's hash and this block's token ids: a hash covers its whole prefix."""
    h = xxhash.xxh64()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


@dataclass(slots=True, eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    """Set once the block is full and computed; None for a block the cache does not know."""
    parent_hash: int | None = None
    token_ids: tuple[int, ...] = ()
    """The tokens behind block_hash: a hit must match them exactly (hash collisions)."""

    def reset_hash(self) -> None:
        self.block_hash = None
        self.parent_hash = None
        self.token_ids = ()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # block_id -> block, least recently freed first; popitem(last=False) takes the LRU.
        self.free_blocks: OrderedDict[int, Block] = OrderedDict((b.block_id, b)
                                                                for b in self.blocks)
        self.cached: dict[int, Block] = {}

    @property
    def num_free(self) -> int:
        """Blocks with no owner (some still hold cached KV that a later hit may revive)."""
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by a sequence (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self.free_blocks) / self.num_blocks

    def allocate(self) -> Block:
        """Take the least recently freed block; it forgets the prefix it cached."""
        if not self.free_blocks:
            raise RuntimeError("block pool exhausted: the caller must check num_free first")
        _, block = self.free_blocks.popitem(last=False)
        assert block.ref_count == 0
        self._evict(block)
        block.ref_count = 1
        return block

    def lookup(self, block_hash: int, parent_hash: int | None,
               token_ids: Sequence[int]) -> Block | None:
        """The cached block for this (hash, parent, tokens), or None on a miss or a collision."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != tuple(token_ids):
            return None
        return block

    def touch(self, block: Block) -> None:
        """Take a reference on a block found in the cache (reviving it if it was free)."""
        if block.ref_count == 0:
            del self.free_blocks[block.block_id]
        block.ref_count += 1

    def free(self, block: Block) -> None:
        """Drop a reference; an unowned block becomes the most recently freed."""
        assert block.ref_count > 0, f"double free of block {block.block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self.free_blocks[block.block_id] = block

    def register(self, block: Block, block_hash: int, parent_hash: int | None,
                 token_ids: Sequence[int]) -> None:
        """Offer a full, computed block to the prefix cache. If another block already holds
        this prefix (two identical prompts computed at once) the first one stays the cached copy."""
        if block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.parent_hash = parent_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.reset_hash()
