"""paged_attention against dense attention with an explicit causal mask, per sequence in float64."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.kernels import paged_attention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [q_len, H, D], k/v [seq_len, KVH, D]: the last q_len positions attend causally."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale  # [q_len, seq_len]
        for i in range(q_len):
            pos = seq_len - q_len + i
            row = scores[i].clone()
            row[pos + 1:] = float("-inf")
            out[i, h] = torch.softmax(row, dim=0) @ vh
    return out


def _run_case(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, gen: torch.Generator) -> None:
    num_seqs = len(q_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # one spare column: padding
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    free = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, not in order
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, s in enumerate(seq_lens):
        ids = [free.pop() for _ in range(-(-s // block_size))]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        dense_k.append(torch.cat([k_cache[b] for b in ids])[:s])
        dense_v.append(torch.cat([v_cache[b] for b in ids])[:s])
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    out = paged_attention(q, k_cache, v_cache, block_tables,
                          torch.tensor(seq_lens, dtype=torch.int32), qsl, scale)
    assert out.shape == q.shape
    for i in range(num_seqs):
        a, b = int(qsl[i]), int(qsl[i + 1])
        ref = _reference(q[a:b], dense_k[i], dense_v[i], scale)
        torch.testing.assert_close(out[a:b].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (6, 1), (12, 12)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_chunks_and_decodes(num_heads: int, num_kv_heads: int, block_size: int) -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    # a fresh prompt, decodes at and across block boundaries, a later chunk, odd lengths
    q_lens = [7, 1, 1, 5, 1, 13, 1]
    ctx_lens = [0, block_size - 1, block_size, 2 * block_size + 3, 0, 9, 37]
    _run_case(q_lens, ctx_lens, num_heads, num_kv_heads, 32, block_size, gen)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_only_batch(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    ctx = torch.randint(0, 70, (11,), generator=gen).tolist()
    _run_case([1] * 11, ctx, 9, 3, head_dim, 16, gen)


def test_prefill_only_and_single_token_prompt() -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    _run_case([17, 1, 33], [0, 0, 0], 4, 2, 8, 8, gen)
    _run_case([64], [0], 4, 2, 8, 16, gen)  # exactly four full blocks


def test_decodes_of_very_different_lengths_are_grouped_correctly() -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    ctx = [3, 300, 5, 90, 700, 1, 150, 41]  # several length groups, out of order
    _run_case([1] * len(ctx), ctx, 9, 3, 16, 16, gen)
    _run_case([1, 9, 1, 1, 4], [500, 0, 2, 130, 64], 4, 2, 8, 8, gen)  # with chunks in between
