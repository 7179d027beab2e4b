"""BlockManager: the scheduler's only view of KV blocks. It finds cached prefixes, grows a
sequence's block table for the tokens of a step (or says no: someone must be preempted),
offers newly full blocks to the prefix cache and frees tables, tail first.
"""

from __future__ import annotations

from shoal.services.engine.core.block_pool import Block, BlockPool, HashFn, hash_block_tokens
from shoal.services.engine.core.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 hash_fn: HashFn = hash_block_tokens) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.hash_fn = hash_fn
        self.pool = BlockPool(num_blocks)
        self.num_prefix_queries = 0
        """Tokens looked up in the prefix cache (vLLM's vllm:prefix_cache_queries)."""
        self.num_prefix_hits = 0
        """Of those, tokens served from the cache (vllm:prefix_cache_hits)."""

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq: Sequence) -> list[Block]:
        """The longest run of leading full blocks of seq already in the cache. At most
        (num_tokens - 1) tokens: the last token is always computed, for its logits."""
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        hashes = self._hashes(seq, max_blocks)
        found: list[Block] = []
        for i in range(max_blocks):
            parent = hashes[i - 1] if i else seq.hash_root
            block = self.pool.lookup(hashes[i], parent, seq.token_ids[i * bs:(i + 1) * bs])
            if block is None:
                break
            found.append(block)
        return found

    def shared_prefix(self, seq: Sequence, sibling: Sequence) -> list[Block]:
        """The sibling's full prompt blocks that seq (same prompt, n > 1) can share, leaving at
        least seq's last prompt token to compute."""
        num_blocks = min((seq.num_tokens - 1) // self.block_size,
                         sibling.num_computed_tokens // self.block_size, len(sibling.block_ids))
        assert seq.token_ids[:num_blocks * self.block_size] == \
            sibling.token_ids[:num_blocks * self.block_size]
        return [self.pool.blocks[i] for i in sibling.block_ids[:num_blocks]]

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[Block] | None = None) -> bool:
        """Make room for num_new_tokens tokens after seq.num_computed_tokens. For a sequence
        that holds no blocks yet, computed_blocks (a cache hit or a sibling's shared prompt)
        become its leading blocks and num_computed_tokens moves past them; None means no
        lookup was made (no prefix-cache stats). False, changing nothing, if the pool is short."""
        computed = computed_blocks or []
        if computed:
            assert not seq.block_ids and seq.num_computed_tokens == 0
        num_computed = seq.num_computed_tokens + len(computed) * self.block_size
        num_needed = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_needed - len(seq.block_ids) - len(computed)
        num_revived = sum(1 for b in computed if b.ref_count == 0)
        if num_new_blocks > self.pool.num_free - num_revived:
            return False
        if computed_blocks is not None:
            self.num_prefix_queries += seq.num_tokens
            self.num_prefix_hits += len(computed) * self.block_size
        for block in computed:
            self.pool.touch(block)
            seq.block_ids.append(block.block_id)
        if computed:
            seq.num_computed_tokens = num_computed
            seq.num_registered_blocks = len(computed)
        for _ in range(num_new_blocks):
            seq.block_ids.append(self.pool.allocate().block_id)
        return True

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Offer the blocks that became full and computed to the prefix cache."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = min(seq.num_computed_tokens // bs, len(seq.block_ids))
        if num_full <= seq.num_registered_blocks:
            return
        hashes = self._hashes(seq, num_full)
        for i in range(seq.num_registered_blocks, num_full):
            self.pool.register(self.pool.blocks[seq.block_ids[i]], hashes[i],
                               hashes[i - 1] if i else seq.hash_root,
                               seq.token_ids[i * bs:(i + 1) * bs])
        seq.num_registered_blocks = num_full

    def trim(self, seq: Sequence) -> None:
        """Give back the tail blocks beyond what seq's tokens need (slots reserved for draft
        tokens that were rejected: never full, so never registered in the cache)."""
        keep = max(self.blocks_needed(seq.num_tokens), seq.num_registered_blocks)
        while len(seq.block_ids) > keep:
            self.pool.free(self.pool.blocks[seq.block_ids.pop()])

    def free(self, seq: Sequence) -> None:
        """Release the table in reverse, so the tail blocks are the first to be evicted."""
        for block_id in reversed(seq.block_ids):
            self.pool.free(self.pool.blocks[block_id])
        seq.block_ids.clear()
        seq.num_registered_blocks = 0

    def _hashes(self, seq: Sequence, num_blocks: int) -> list[int]:
        """seq.block_hashes, extended to cover its first num_blocks full blocks. The first
        block's parent is the sequence's LoRA adapter root (None for the base model), so every
        hash covers the adapter too: one adapter's blocks never serve another."""
        hashes = seq.block_hashes
        bs = self.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            hashes.append(self.hash_fn(hashes[-1] if hashes else seq.hash_root,
                                       seq.token_ids[i * bs:(i + 1) * bs]))
        return hashes
