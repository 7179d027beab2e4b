"""paged_attention against dense attention with an explicit causal (and sliding-window) mask,
per sequence in float64: the plain-torch op and the C++ op that reads the cache in place; with
soft-capped scores and with attention sinks (gpt-oss) too."""

from __future__ import annotations

import math

import pytest
import torch
from tests.seeding import fresh_generator

from shoal.kernels import cpu_ops, paged_attention

OPS = {"torch": paged_attention, "cpp": cpu_ops.paged_attention}


@pytest.fixture(params=list(OPS))
def op(request: pytest.FixtureRequest):  # noqa: ANN201
    if request.param == "cpp" and not cpu_ops.load():
        pytest.fail("the C++ attention op did not build (see the warning)")
    return OPS[request.param]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None = None, softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [q_len, H, D], k/v [seq_len, KVH, D]: the last q_len positions attend causally; with a
    window, position p sees keys p - window + 1 .. p (transformers: kv_idx > q_idx - window);
    with sinks [H], head h's softmax has one more logit, sinks[h], with no value."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for h in range(num_heads):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * scale  # [q_len, seq_len]
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        for i in range(q_len):
            pos = seq_len - q_len + i
            row = scores[i].clone()
            row[pos + 1:] = float("-inf")
            if window is not None:
                row[:max(0, pos - window + 1)] = float("-inf")
            if sinks is None:
                out[i, h] = torch.softmax(row, dim=0) @ vh
            else:  # exp(s) / (sum exp(s) + exp(sink)), written out
                weights = torch.exp(row - row.max())
                denom = weights.sum() + torch.exp(sinks[h].double() - row.max())
                out[i, h] = (weights / denom) @ vh
    return out


def _run_case(op, q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int,
              head_dim: int, block_size: int, gen: torch.Generator,
              window: int | None = None, softcap: float | None = None,
              sinks: torch.Tensor | None = None) -> None:
    """With a window, the blocks before it hold NaN: the op must skip them, not mask them."""
    num_seqs = len(q_lens)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1  # one spare column: padding
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    # scattered, not in order; block 0 stays clean: the table's padding columns point at it
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    dense_k, dense_v = [], []
    for i, s in enumerate(seq_lens):
        ids = [free.pop() for _ in range(-(-s // block_size))]
        block_tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        dense_k.append(torch.cat([k_cache[b] for b in ids])[:s])
        dense_v.append(torch.cat([v_cache[b] for b in ids])[:s])
        if window is not None:  # NaN in blocks wholly before the window: they must not be read
            skipped = ids[:max(0, ctx_lens[i] - window + 1) // block_size]
            k_cache[skipped] = v_cache[skipped] = float("nan")
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    scale = 1.0 / math.sqrt(head_dim)
    capped: dict = {"softcap": softcap} if softcap else {}
    if sinks is not None:
        capped["sinks"] = sinks
    out = op(q, k_cache, v_cache, block_tables, torch.tensor(seq_lens, dtype=torch.int32), qsl,
             scale, window, **capped)
    assert out.shape == q.shape
    for i in range(num_seqs):
        a, b = int(qsl[i]), int(qsl[i + 1])
        ref = _reference(q[a:b], dense_k[i], dense_v[i], scale, window, softcap, sinks)
        torch.testing.assert_close(out[a:b].double(), ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (8, 2), (6, 1), (12, 12)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_mixed_prefill_chunks_and_decodes(op, num_heads: int, num_kv_heads: int,
                                          block_size: int) -> None:
    gen = fresh_generator()
    # a fresh prompt, decodes at and across block boundaries, a later chunk, odd lengths
    q_lens = [7, 1, 1, 5, 1, 13, 1]
    ctx_lens = [0, block_size - 1, block_size, 2 * block_size + 3, 0, 9, 37]
    _run_case(op, q_lens, ctx_lens, num_heads, num_kv_heads, 32, block_size, gen)


@pytest.mark.parametrize("head_dim", [16, 64])
def test_decode_only_batch(op, head_dim: int) -> None:
    gen = fresh_generator()
    ctx = torch.randint(0, 70, (11,), generator=gen).tolist()
    _run_case(op, [1] * 11, ctx, 9, 3, head_dim, 16, gen)


def test_prefill_only_and_single_token_prompt(op) -> None:
    gen = fresh_generator()
    _run_case(op, [17, 1, 33], [0, 0, 0], 4, 2, 8, 8, gen)
    _run_case(op, [64], [0], 4, 2, 8, 16, gen)  # exactly four full blocks


def test_decodes_of_very_different_lengths_are_grouped_correctly(op) -> None:
    gen = fresh_generator()
    ctx = [3, 300, 5, 90, 700, 1, 150, 41]  # several length groups, out of order
    _run_case(op, [1] * len(ctx), ctx, 9, 3, 16, 16, gen)
    _run_case(op, [1, 9, 1, 1, 4], [500, 0, 2, 130, 64], 4, 2, 8, 8, gen)  # chunks in between


@pytest.mark.parametrize("window", [None, 37])
def test_long_chunks_beside_decodes(op, window: int | None) -> None:
    """Chunks of cpu_ops.LONG_CHUNK tokens and more take the SDPA path inside the C++ op set."""
    gen = fresh_generator()
    long = cpu_ops.LONG_CHUNK
    _run_case(op, [long, 1, long + 45, 1, long - 1], [0, 50, 70, 3, 9], 9, 3, 16, 16, gen, window)


# windows: 1 (a query sees only itself), shorter than a block, at and past block boundaries,
# and longer than every context (the same as full attention)
WINDOWS = [1, 3, 4, 7, 16, 33, 500]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (9, 3), (6, 1)])
def test_sliding_window_mixed_batch(op, window: int, num_heads: int, num_kv_heads: int) -> None:
    gen = fresh_generator()
    block_size = 4
    # whole prompts shorter and longer than the window, decodes at and across block boundaries,
    # later chunks whose first query's window starts mid-block, odd lengths
    q_lens = [7, 1, 1, 5, 1, 13, 1, 40, 1]
    ctx_lens = [0, block_size - 1, block_size, 2 * block_size + 3, 0, 9, 37, 0, 61]
    _run_case(op, q_lens, ctx_lens, num_heads, num_kv_heads, 16, block_size, gen, window)


@pytest.mark.parametrize("window", [5, 16, 100])
def test_sliding_window_decodes_of_different_lengths(op, window: int) -> None:
    gen = fresh_generator()
    # long and short contexts out of order (decodes are grouped by the keys they read)
    ctx = torch.randint(0, 300, (9,), generator=gen).tolist()
    ctx[2:2] = [window - 1, 2, window, 0, window + 1]
    _run_case(op, [1] * len(ctx), ctx, 8, 2, 16, 16, gen, window)  # all decodes: the fast path
    _run_case(op, [1] * len(ctx), ctx, 16, 16, 16, 16, gen, window)  # many KV heads: SDPA
    _run_case(op, [1, 9, 1, 1], [150, 0, window, 3], 8, 2, 16, 8, gen, window)  # with a chunk


def test_window_changes_the_result(op) -> None:
    """Past the window the output differs from full attention (the mask is not a no-op)."""
    gen = fresh_generator()
    k_cache = torch.randn(8, 4, 1, 8, generator=gen)
    v_cache = torch.randn(8, 4, 1, 8, generator=gen)
    tables = torch.arange(8, dtype=torch.int32)[None]
    q = torch.randn(1, 2, 8, generator=gen)
    args = (q, k_cache, v_cache, tables, torch.tensor([20], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32), 0.3)
    assert not torch.allclose(op(*args, 6), op(*args))
    torch.testing.assert_close(op(*args, 20), op(*args))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (12, 12)])
def test_soft_capped_scores(op, window: int | None, num_heads: int, num_kv_heads: int) -> None:
    """Gemma 2's attn_logit_softcapping: decodes, short chunks and a long chunk (the C++ op
    set's SDPA path), against the capped reference; a cap of 0.5 on unit-scale scores is far
    from the identity, so an op that ignores it fails."""
    gen = fresh_generator()
    long = cpu_ops.LONG_CHUNK
    _run_case(op, [1, 5, long, 1, 3], [20, 9, 4, 7, 0], num_heads, num_kv_heads, 16, 4, gen,
              window, softcap=0.5)
    q = torch.randn(1, 2, 8, generator=gen) * 4
    k_cache = torch.randn(2, 4, 2, 8, generator=gen) * 4
    args = (q, k_cache, k_cache.clone(), torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([7], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
    assert not torch.allclose(op(*args, softcap=0.5), op(*args))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (12, 12), (6, 1)])
def test_attention_sinks(op, window: int | None, num_heads: int, num_kv_heads: int) -> None:
    """gpt-oss's sinks: decodes, short chunks and a long chunk (the C++ op set's torch path),
    against the written-out reference; sinks from -2 to 4 on unit-scale scores move every row
    (one far above the scores takes most of the weight), so an op that ignores them fails."""
    gen = fresh_generator()
    sinks = torch.linspace(-2.0, 4.0, num_heads)
    long = cpu_ops.LONG_CHUNK
    _run_case(op, [1, 5, long, 1, 3], [20, 9, 4, 7, 0], num_heads, num_kv_heads, 16, 4, gen,
              window, sinks=sinks)
    _run_case(op, [1, 1, 1], [40, 3, 17], num_heads, num_kv_heads, 8, 16, gen, window,
              softcap=0.5, sinks=sinks)  # capped scores, uncapped sinks (each its own way)
    q = torch.randn(1, 2, 8, generator=gen)
    k_cache = torch.randn(2, 4, 2, 8, generator=gen)
    args = (q, k_cache, k_cache.clone(), torch.tensor([[0, 1]], dtype=torch.int32),
            torch.tensor([7], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), 1.0)
    assert not torch.allclose(op(*args, sinks=torch.tensor([0.0, 3.0])), op(*args))
