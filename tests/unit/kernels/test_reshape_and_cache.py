"""reshape_and_cache writes each token at its slot, skips -1 and touches nothing else."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator

from shoal.kernels import cpu_ops, reshape_and_cache

OPS = {"torch": reshape_and_cache, "cpp": cpu_ops.reshape_and_cache}


@pytest.fixture(params=list(OPS))
def op(request: pytest.FixtureRequest):  # noqa: ANN201
    if request.param == "cpp" and not cpu_ops.load():
        pytest.fail("the C++ op did not build (see the warning)")
    return OPS[request.param]


@pytest.mark.parametrize("block_size,num_kv_heads,head_dim", [(16, 3, 64), (4, 1, 8), (8, 2, 5)])
def test_writes_slots_and_skips_minus_one(op, block_size: int, num_kv_heads: int,
                                          head_dim: int) -> None:
    gen = fresh_generator()
    num_blocks, num_tokens = 6, 13
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[torch.tensor([0, 5, 12])] = -1
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    op(k, v, k_cache, v_cache, slots.long())
    expect_k, expect_v = k_before, v_before
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expect_k[slot // block_size, slot % block_size] = k[t]
            expect_v[slot // block_size, slot % block_size] = v[t]
    assert torch.equal(k_cache, expect_k)
    assert torch.equal(v_cache, expect_v)


def test_all_skipped_is_a_no_op(op) -> None:
    k_cache = torch.zeros(2, 4, 1, 8)
    v_cache = torch.zeros(2, 4, 1, 8)
    op(torch.ones(3, 1, 8), torch.ones(3, 1, 8), k_cache, v_cache,
                      torch.full((3,), -1, dtype=torch.int64))
    assert not k_cache.any() and not v_cache.any()
