"""Triton reshape_and_cache equals the torch reference exactly (a copy): -1 slots skipped,
strided k/v views (as split from the packed qkv projection), non-power-of-two widths."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from tests.unit.kernels_triton.triton_helpers import DEVICE, DTYPES

from shoal.kernels import reshape_and_cache
from shoal.kernels.reshape_and_cache_triton import reshape_and_cache_triton


def distinct_slots(num_slots: int, num_tokens: int, boundary: int,
                   gen: torch.Generator) -> torch.Tensor:
    """num_tokens different slots, the last one `boundary` (the first slot of block 1). Two
    tokens never share a slot: the order of two writes to one slot is undefined on a GPU, for the
    kernel and for `index_copy_` alike (the first GPU run's 5 failures were such a repeat)."""
    others = torch.randperm(num_slots - 1, generator=gen)[:num_tokens - 1]
    others = others + (others >= boundary).long()  # every slot but `boundary`
    return torch.cat([others, torch.tensor([boundary])])


def test_distinct_slots_never_repeat() -> None:
    gen = fresh_generator()
    for _ in range(200):
        slots = distinct_slots(20, 11, 4, gen)
        assert slots.unique().numel() == 11 and slots[-1] == 4 and slots.max() < 20


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 3, 64), (4, 1, 8), (8, 2, 5),
                                                              (16, 8, 128)])
def test_matches_reference(dtype: torch.dtype, block_size: int, num_kv_heads: int,
                           head_dim: int) -> None:
    gen = fresh_generator()
    num_blocks, num_tokens, num_heads = 5, 11, 2 * num_kv_heads
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    kv = num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, num_heads * head_dim + 2 * kv, generator=gen).to(dtype).to(DEVICE)
    _, k, v = qkv.split([num_heads * head_dim, kv, kv], dim=-1)
    k = k.view(num_tokens, num_kv_heads, head_dim)  # strided: rows of the packed projection
    v = v.view(num_tokens, num_kv_heads, head_dim)
    slots = distinct_slots(num_blocks * block_size, num_tokens, block_size, gen)
    slots[torch.randint(0, num_tokens - 1, (3,), generator=gen)] = -1
    slots = slots.to(DEVICE)
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    reshape_and_cache(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)


def test_all_skipped_and_empty_are_no_ops() -> None:
    k_cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    v_cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    ones = torch.ones(3, 1, 8, device=DEVICE)
    reshape_and_cache_triton(ones, ones, k_cache, v_cache,
                             torch.full((3,), -1, dtype=torch.int64, device=DEVICE))
    empty = torch.ones(0, 1, 8, device=DEVICE)
    reshape_and_cache_triton(empty, empty, k_cache, v_cache,
                             torch.zeros(0, dtype=torch.int64, device=DEVICE))
    assert not k_cache.any() and not v_cache.any()


def test_layout_is_checked() -> None:
    k_cache = torch.zeros(2, 4, 2, 8, device=DEVICE)
    kv = torch.ones(3, 2, 8, device=DEVICE)
    slots = torch.zeros(3, dtype=torch.int64, device=DEVICE)
    with pytest.raises(AssertionError):
        reshape_and_cache_triton(kv, kv, k_cache.transpose(2, 3).contiguous().transpose(2, 3),
                                 k_cache, slots)
    with pytest.raises(AssertionError):
        reshape_and_cache_triton(kv, kv, k_cache, k_cache.clone(), slots.int())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_padded_batch_odd_strides_one_block(dtype: torch.dtype) -> None:
    """What a CUDA-graph step hands the kernel: whole blocks written by many programs at once
    (consecutive slots), padding tokens (-1) at the tail, and k/v rows with an odd token stride
    (views into a wider buffer); slots outside the written ones keep their values."""
    gen = fresh_generator()
    block_size, num_kv_heads, head_dim, num_blocks = 16, 2, 24, 4
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    v_cache = torch.randn(shape, generator=gen).to(dtype).to(DEVICE)
    k_ref, v_ref, k_before = k_cache.clone(), v_cache.clone(), k_cache.clone()
    real, padded = 2 * block_size + 3, 2 * block_size + 3 + 13  # 13 padding tokens
    width = 2 * num_kv_heads * head_dim + 7  # an odd row stride
    buf = torch.randn(padded, width, generator=gen).to(dtype).to(DEVICE)
    kv = num_kv_heads * head_dim
    k = buf[:, 3:3 + kv].view(padded, num_kv_heads, head_dim)
    v = buf[:, 3 + kv:3 + 2 * kv].view(padded, num_kv_heads, head_dim)
    assert k.stride(0) == width and width % 2 == 1
    first = torch.arange(block_size, 3 * block_size + 3)  # all of block 1, 2 and 3 slots of 3
    slots = torch.cat([first, torch.full((padded - real,), -1)]).to(DEVICE)
    reshape_and_cache_triton(k, v, k_cache, v_cache, slots)
    reshape_and_cache(k, v, k_ref, v_ref, slots)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(k_cache[0], k_before[0])  # block 0: no slot of it was named
    assert not torch.equal(k_cache[1], k_before[1])
