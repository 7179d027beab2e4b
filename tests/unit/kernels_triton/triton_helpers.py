"""Shared pieces of the Triton kernel tests: the device they run on, dtypes, CUDA skip marks,
and a random paged-cache case (scattered blocks, one spare block-table column)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# The interpreter computes bf16 wrongly (docs/kernels.md): bf16 runs on the GPU only.
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device (none here): "
                                "GPU-only check skipped, the interpreter runs the rest")


class _OneDevice(TorchDispatchMode):
    """Refuses any op whose tensors sit on two devices (a CPU 0-dim scalar aside, which CUDA ops
    take too), naming the op."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        devices = {t.device for t in pytree.tree_leaves((args, kwargs))
                   if isinstance(t, torch.Tensor) and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise AssertionError(f"{func} mixes tensors on {sorted(map(str, devices))}: a tensor "
                                 "was made without taking its device from an input")
        return func(*args, **kwargs)


@contextmanager
def tensors_beside_inputs() -> Iterator[None]:
    """The CUDA path's device plumbing, checked without a GPU: every tensor made without a device
    lands on `meta`, and an op mixing it with the (CPU or CUDA) inputs fails with the op's name.
    The first GPU run's `cuda:0 and cpu` failure (an `arange` for the prefill mask) is this."""
    with _OneDevice(), torch.device("meta"):
        yield


@dataclass
class PagedCase:
    q: torch.Tensor  # [num_tokens, num_heads, head_dim]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    scale: float


def paged_case(q_lens: list[int], ctx_lens: list[int], num_heads: int, num_kv_heads: int,
               head_dim: int, block_size: int, dtype: torch.dtype, gen: torch.Generator
               ) -> PagedCase:
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 3
    max_blocks = max(-(-s // block_size) for s in seq_lens) + 1
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    block_tables = torch.zeros(len(q_lens), max_blocks, dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        ids = [free.pop() for _ in range(-(-s // block_size))]
        block_tables[i, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    return PagedCase(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), block_tables.to(DEVICE),
                     torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), qsl.to(DEVICE),
                     head_dim ** -0.5)


def tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Relative bounds for fp32 accumulation over inputs of `dtype` (bf16: 8 mantissa bits)."""
    return {torch.float32: {"atol": 2e-5, "rtol": 2e-5},
            torch.float16: {"atol": 2e-3, "rtol": 2e-3},
            torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}[dtype]


def poison_before_window(case: PagedCase, window: int) -> PagedCase:
    """A copy of `case` whose cache blocks wholly before the window of each sequence's first
    query hold NaN: an op that reads any of them (rather than skipping it) returns NaN."""
    block_size = case.k_cache.shape[1]
    k_cache, v_cache = case.k_cache.clone(), case.v_cache.clone()
    qsl = case.query_start_loc.tolist()
    for i, seq_len in enumerate(case.seq_lens.tolist()):
        first_query = seq_len - (qsl[i + 1] - qsl[i])
        num_skipped = max(0, first_query - window + 1) // block_size
        blocks = case.block_tables[i, :num_skipped].long()
        k_cache[blocks] = float("nan")
        v_cache[blocks] = float("nan")
    return PagedCase(case.q, k_cache, v_cache, case.block_tables, case.seq_lens,
                     case.query_start_loc, case.scale)
