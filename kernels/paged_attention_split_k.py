"""Split-K (flash-decoding) for paged_attention: the rule that picks it and the kernel that merges
the partial results. Each split of a sequence's keys leaves (acc, max, sum) per query row; the
merge rescales them to the global max. The attention kernel itself is paged_attention_triton's."""

from __future__ import annotations

import triton
import triton.language as tl

SPLIT_MAX_SEQS = 16
"""Up to this many decoding sequences (x ~8 KV heads ~ one wave on a 132-SM GPU) may split."""
SPLIT_MIN_SEQ_LEN = 1024
"""Contexts shorter than this are read fast enough by one program per (sequence, KV head)."""
SPLIT_KEYS = 512
"""About this many keys per split; at most MAX_SPLITS splits."""
MAX_SPLITS = 16


def use_split_k(num_seqs: int, max_seq_len: int) -> bool:
    """Split the keys when few sequences leave most of the GPU idle and contexts are long."""
    return num_seqs <= SPLIT_MAX_SEQS and max_seq_len >= SPLIT_MIN_SEQ_LEN


def num_splits_for(num_seqs: int, max_seq_len: int) -> int:
    """1 when `use_split_k` says no, else max_seq_len / SPLIT_KEYS clamped to [2, MAX_SPLITS]."""
    if not use_split_k(num_seqs, max_seq_len):
        return 1
    return max(2, min(MAX_SPLITS, max_seq_len // SPLIT_KEYS))


@triton.jit
def merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, out_stride_t, out_stride_h,
                        NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """One program per (token, head): out = sum_s acc_s 2^(m_s - M) / sum_s l_s 2^(m_s - M)."""
    token = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [BLOCK_S]
    m = tl.load(part_ml_ptr + row * 2, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_ml_ptr + row * 2 + 1, mask=s_mask, other=0.0)
    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)  # no key at all (a padded lane)
    w = tl.exp2(m - m_max)  # [BLOCK_S]
    l_sum = tl.sum(l_part * w, axis=0)
    l_sum = tl.where(l_sum == 0.0, 1.0, l_sum)
    mask = s_mask[:, None] & (offs_d[None, :] < HEAD_DIM)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / l_sum  # [BLOCK_D]
    dst = out_ptr + token * out_stride_t + head * out_stride_h + offs_d
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=offs_d < HEAD_DIM)
