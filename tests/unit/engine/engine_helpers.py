"""Shared test helpers for the engine core: a fake model runner that checks the KV contract as
it goes, a character tokenizer, and assert_pool_whole (no block is ever leaked)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from shoal.services.engine.core.block_pool import BlockPool
from shoal.services.engine.core.outputs import RunnerOutput, SchedulerOutput, TokenLogprob
from shoal.services.engine.core.scheduler import Scheduler
from shoal.services.engine.core.sequence import Sequence

VOCAB = 1000
EOS = 0


def default_next_token(tokens: list[int], seed_offset: int) -> int:
    """A deterministic 'model': the next token depends on the whole context (never EOS)."""
    h = 17 + seed_offset
    for t in tokens:
        h = (h * 31 + t) % 1_000_003
    return 1 + h % (VOCAB - 1)


class FakeRunner:
    """Stands in for ModelRunner. Keeps its own copy of each sequence's tokens (resetting on
    start_pos == 0 or prefix_token_ids, as the contract says) and a fake KV cache (slot -> the
    token written there), and checks every step reads a context equal to the sequence's tokens:
    a prefix-cache hit, a shared block or a recompute that put wrong KV in place fails loudly."""

    def __init__(self, num_kv_blocks: int = 64, block_size: int = 16, max_model_len: int = 512,
                 next_token: Callable[[list[int], int], int] = default_next_token,
                 logprobs: bool = False) -> None:
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset({EOS})
        self.vocab_size = VOCAB
        self.next_token = next_token
        self.with_logprobs = logprobs
        self.tokens: dict[int, list[int]] = {}
        self.kv: dict[int, int] = {}
        self.steps: list[SchedulerOutput] = []
        self.dropped: set[int] = set()
        self.hook: Callable[[SchedulerOutput], None] | None = None

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        self.steps.append(out)
        if self.hook is not None:
            self.hook(out)
        for seq_id in out.finished_seq_ids:
            self.tokens.pop(seq_id, None)
            self.dropped.add(seq_id)
        sampled: dict[int, int] = {}
        logprobs: dict[int, TokenLogprob] = {}
        prompt_lps: dict[int, list[TokenLogprob | None]] = {}
        bs = self.block_size
        for s in out.scheduled:
            if s.start_pos == 0 or s.prefix_token_ids is not None:
                self.tokens[s.seq_id] = list(s.prefix_token_ids or [])
            mine = self.tokens[s.seq_id]
            assert len(mine) == s.start_pos, (s.seq_id, len(mine), s.start_pos)
            mine.extend(s.token_ids)
            end = len(mine)
            assert len(s.block_ids) * bs >= end, "block table too short for this step"
            assert len(set(s.block_ids)) == len(s.block_ids)
            # A position's KV depends on its whole prefix: model it as a rolling hash.
            ctx = _prefix_hashes(mine)
            for pos in range(s.start_pos, end):  # write this step's KV
                self.kv[s.block_ids[pos // bs] * bs + pos % bs] = ctx[pos]
            for pos in range(end):  # attend over the whole context: it must be the right one
                slot = s.block_ids[pos // bs] * bs + pos % bs
                assert self.kv.get(slot) == ctx[pos], f"seq {s.seq_id}: wrong KV at {pos}"
            if s.want_prompt_logprobs:
                lps: list[TokenLogprob | None] = [None] if s.start_pos == 0 else []
                for pos in range(max(s.start_pos, 1), min(end, s.prompt_len)):
                    lps.append(TokenLogprob(mine[pos], -float(pos), 1))
                prompt_lps[s.seq_id] = lps
            if s.is_sampling:
                token = self.next_token(mine, s.seed_offset)
                sampled[s.seq_id] = token
                if self.with_logprobs:
                    logprobs[s.seq_id] = TokenLogprob(token, -0.5, 1, [(token, -0.5)])
        return RunnerOutput(sampled, logprobs, prompt_lps)


def _prefix_hashes(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = (h * 1_000_003 + t + 1) % (1 << 61)
        out.append(h)
    return out


class CharTokenizer:
    """decode(ids) = one lowercase letter per id; 'special' id EOS decodes to '<eos>'.
    encode maps letters back (a -> 26, ..., z -> 51); a toy chat template joins messages."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [26 + ord(c) - ord("a") for c in text if "a" <= c <= "z"]

    def __len__(self) -> int:
        return VOCAB

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = False,
                            add_generation_prompt: bool = True, chat_template: str | None = None,
                            tools: list[dict] | None = None) -> str:
        text = "".join(f"{m['role']}{m['content']}" for m in conversation)
        return text + ("assistant" if add_generation_prompt else "")

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = True,
               clean_up_tokenization_spaces: bool | None = None) -> str:
        out = []
        for t in token_ids:
            if t == EOS:
                if not skip_special_tokens:
                    out.append("<eos>")
            else:
                out.append(chr(ord("a") + t % 26))
        return "".join(out)


def assert_pool_whole(pool: BlockPool, live: Iterable[Sequence] = ()) -> None:
    """Every block is either owned (ref_count = number of live tables holding it) or on the
    free list exactly once; the cache index only points at blocks carrying that hash. With no
    live sequences every block must be free again: nothing leaked."""
    owners: dict[int, int] = {}
    for seq in live:
        for block_id in seq.block_ids:
            owners[block_id] = owners.get(block_id, 0) + 1
    assert len(pool.free_blocks) == len(set(pool.free_blocks))
    for block in pool.blocks:
        owned = owners.get(block.block_id, 0)
        assert block.ref_count == owned, \
            f"block {block.block_id}: ref_count {block.ref_count} != {owned}"
        assert (block.ref_count == 0) == (block.block_id in pool.free_blocks), block.block_id
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert pool.num_free + len(owners) == pool.num_blocks


def assert_scheduler_whole(scheduler: Scheduler) -> None:
    live = list(scheduler.running)
    for seq in scheduler.waiting:
        assert not seq.block_ids, "a waiting sequence holds blocks"
    assert_pool_whole(scheduler.block_manager.pool, live)
