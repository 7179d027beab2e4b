"""paged_attention in Triton (the CUDA path): varlen queries over the paged cache, causal, GQA,
optional sliding window, optional logit soft-cap (Gemma 2), optional attention sinks (gpt-oss),
fp16/bf16 inputs with fp32 accumulation and an online softmax (base 2).

One program per (block of query rows, KV head[, split]): the rows are BLOCK_Q tokens x the
QPKV query heads sharing that KV head, so decodes fill a 16-row tile and K/V are read once per
group. Sequences are found by binary search over `query_start_loc` (no host sync, graph-safe).
With a window, key tiles wholly before the window of a program's first query are never loaded;
the tiles that straddle a window edge are masked per row. A sink (one logit per query head,
no value) starts the online softmax of a row's first split as if it were a key already seen:
running max = the sink, running sum = 1, accumulator = 0; split-K's merge then counts it once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from shoal.kernels._utils import check_heads, check_kv_cache, check_same_device, is_interpreting
from shoal.kernels._utils import next_power_of_2
from shoal.kernels.paged_attention import DECODE_GROUP_BYTES, check_window
from shoal.kernels.paged_attention_split_k import merge_splits_kernel, num_splits_for

LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The last sequence i whose first query block (qsl[i] // BLOCK_Q + i) is <= q_block."""
    lo: tl.int32 = 0  # typed: loop-carried, and num_seqs == 1 arrives as a constant
    hi: tl.int32 = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
        block_tables_ptr, seq_lens_ptr, qsl_ptr, sinks_ptr, qk_scale, softcap, num_seqs, window,
        q_stride_t, q_stride_h, out_stride_t, out_stride_h, bt_stride,
        cache_stride_b, cache_stride_s, cache_stride_h,
        NUM_HEADS: tl.constexpr, QPKV: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, NUM_SPLITS: tl.constexpr,
        HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
        PRECISION: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(qsl_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    ctx_len = seq_len - q_len  # keys already cached before this step's tokens

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    q_idx = local * BLOCK_Q + offs_m // QPKV  # [BLOCK_M] query token within this step's chunk
    head = kv_head * QPKV + offs_m % QPKV  # [BLOCK_M] query head
    row_mask = (offs_m // QPKV < BLOCK_Q) & (q_idx < q_len)
    d_mask = offs_d < HEAD_DIM
    token = q_start + q_idx
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h + offs_d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]

    key_end = tl.minimum(seq_len, ctx_len + (local + 1) * BLOCK_Q)  # causal: no key past this
    num_tiles = tl.cdiv(key_end, TILE)
    first_tile = 0
    if HAS_WINDOW:  # the first query (position ctx_len + local * BLOCK_Q) sees no key before this
        first_tile = tl.maximum(ctx_len + local * BLOCK_Q - window + 1, 0) // TILE
    tiles_per_split = tl.cdiv(num_tiles - first_tile, NUM_SPLITS)
    tile_lo = first_tile + split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    if HAS_SINKS:  # the sink as a key already seen (log2 units), in split 0 only
        sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0).to(tl.float32)
        m_i = tl.where(split == 0, sink * 1.4426950408889634, m_i)  # log2(e)
        l_i = tl.where(split == 0, 1.0, l_i)
    offs_t = tl.arange(0, TILE)
    for t in range(tile_lo, tile_hi):
        pos = t * TILE + offs_t  # [TILE] key positions
        pos_mask = pos < key_end
        block = tl.load(block_tables_ptr + seq * bt_stride + pos // BLOCK_SIZE, mask=pos_mask,
                        other=0).to(tl.int64)
        base = (block * cache_stride_b + (pos % BLOCK_SIZE) * cache_stride_s
                + kv_head * cache_stride_h)  # [TILE] int64
        k = tl.load(k_cache_ptr + base[None, :] + offs_d[:, None],
                    mask=pos_mask[None, :] & d_mask[:, None], other=0.0)  # [BLOCK_D, TILE]
        s = tl.dot(q, k, input_precision=PRECISION) * qk_scale  # [BLOCK_M, TILE], log2 units
        if HAS_SOFTCAP:  # qk_scale is the plain scale here: cap, then to log2 units
            x = s / softcap  # softcap * tanh(x), tanh(x) = 1 - 2 / (e^2x + 1) (saturates at +-1)
            s = softcap * (1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0))  # 2 log2(e)
            s = s * 1.4426950408889634  # log2(e)
        visible = pos_mask[None, :] & (pos[None, :] <= (ctx_len + q_idx)[:, None])
        if HAS_WINDOW:  # query position p sees keys in (p - window, p]
            visible = visible & (pos[None, :] > (ctx_len + q_idx - window)[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no visible key yet
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(v_cache_ptr + base[:, None] + offs_d[None, :],
                    mask=pos_mask[:, None] & d_mask[None, :], other=0.0)  # [TILE, BLOCK_D]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        dst = (out_ptr + token[:, None] * out_stride_t + head[:, None] * out_stride_h
               + offs_d[None, :])
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:  # partials [num_tokens, NUM_HEADS, NUM_SPLITS, HEAD_DIM] and [..., 2] (max, sum)
        row = (token * NUM_HEADS + head) * NUM_SPLITS + split  # [BLOCK_M]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)
        tl.store(part_ml_ptr + row * 2, m_i, mask=row_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=row_mask)


def paged_attention_triton(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim], token stride free
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context length after this step
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    window: int | None = None,
    workspace: object | None = None,
    max_group_bytes: int = DECODE_GROUP_BYTES,
    *,
    num_splits: int | None = None,
    tile_size: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Same contract as the torch op (`window`: keys in (p - window, p], None = all).
    `workspace` and `max_group_bytes` (the CPU path's gather tuning) are accepted and unused:
    the kernel reads the paged cache in place. `softcap` (None = off): scores s -> softcap *
    tanh(s / softcap) before the softmax, as the torch op; `sinks` ([num_heads], None = off):
    each head's sink logit in its softmax's denominator, as the torch op. All-decode batches
    split the keys by `num_splits_for(num_seqs, max_keys)`, where max_keys is bounded by the
    block table's width and the window (no sync); `num_splits` forces it."""
    del workspace, max_group_bytes
    check_window(window)
    block_size, num_kv_heads, head_dim = check_kv_cache(k_cache, v_cache)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    check_heads(q, num_heads, head_dim, "q")
    assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
    num_seqs = seq_lens.shape[0]
    assert block_tables.dtype == seq_lens.dtype == query_start_loc.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs
    assert block_tables.stride(1) == 1 and seq_lens.is_contiguous()
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.is_contiguous()
    assert q.dtype == k_cache.dtype, (q.dtype, k_cache.dtype)
    check_same_device(q, k_cache, block_tables, seq_lens, query_start_loc)
    if sinks is not None:
        assert sinks.shape == (num_heads,) and sinks.is_contiguous(), tuple(sinks.shape)
        check_same_device(q, sinks)
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    qpkv = num_heads // num_kv_heads
    is_decode = num_tokens == num_seqs  # every sequence brings exactly one token
    block_m = max(16 if is_decode else 64, next_power_of_2(qpkv))
    block_q = block_m // qpkv
    if num_splits is None:
        max_keys = block_tables.shape[1] * block_size  # an upper bound, known without a sync
        if window is not None:  # a decode reads at most `window` keys (+ one straddled tile)
            max_keys = min(max_keys, window)
        num_splits = num_splits_for(num_seqs, max_keys) if is_decode else 1
    tile = tile_size or (32 if is_interpreting() else 64)
    block_d = max(16, next_power_of_2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty((num_tokens, num_heads, num_splits, head_dim), dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty((num_tokens, num_heads, num_splits, 2), dtype=torch.float32,
                              device=q.device)
    else:
        part_acc = part_ml = out  # unused
    grid = (num_tokens // block_q + num_seqs, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, seq_lens, query_start_loc,
        out if sinks is None else sinks, scale if softcap else scale * LOG2E, softcap or 1.0,
        num_seqs, window or 0,
        q.stride(0), q.stride(1), out.stride(0),
        out.stride(1),
        block_tables.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_HEADS=num_heads, QPKV=qpkv, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_SIZE=block_size, TILE=tile, BLOCK_M=block_m, BLOCK_Q=block_q,
        NUM_SPLITS=num_splits, HAS_WINDOW=window is not None, HAS_SOFTCAP=bool(softcap),
        HAS_SINKS=sinks is not None,
        PRECISION="ieee" if q.dtype == torch.float32 else None)
    if num_splits > 1:
        merge_splits_kernel[(num_tokens, num_heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), NUM_HEADS=num_heads,
            NUM_SPLITS=num_splits, BLOCK_S=next_power_of_2(num_splits), HEAD_DIM=head_dim,
            BLOCK_D=block_d)
    return out
