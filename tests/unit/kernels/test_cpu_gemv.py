"""The C++ GEMV (csrc/cpu_gemv.cpp) against F.linear: one and two rows, sizes that are not
multiples of its vector width (16) or row block (8), with and without a bias, on one thread and
split across two; what it refuses it refuses with a clear error."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
import torch.nn.functional as F

from shoal.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(96, 40), (3072, 576), (5, 3), (577, 1537)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_matches_f_linear(threads: int, rows: int, n: int, k: int, bias: bool) -> None:
    gen = fresh_generator()
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    out = cpu_ops.gemv(x, w, b)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x.double(), w.double(),
                                             None if b is None else b.double()).float(),
                               atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_gemv_of_no_rows_is_empty() -> None:  # a step whose tokens need no logits
    assert cpu_ops.gemv(torch.randn(0, 8), torch.randn(4, 8), torch.randn(4)).shape == (0, 4)


def test_gemv_takes_a_strided_row_and_is_deterministic() -> None:
    w = torch.randn(64, 48)
    x = torch.randn(1, 96)[:, ::2]  # a view, as a step's hidden state may be
    assert torch.equal(cpu_ops.gemv(x, w, None), cpu_ops.gemv(x.contiguous(), w, None))


@pytest.mark.parametrize(("x", "w", "message"), [
    (torch.randn(3, 8), torch.randn(4, 8), "one or two rows"),
    (torch.randn(1, 8), torch.randn(4, 7), r"x \[M, K\] and weight \[N, K\]"),
    (torch.randn(1, 8, dtype=torch.bfloat16), torch.randn(4, 8), "float32"),
    (torch.randn(1, 8), torch.randn(8, 4).t(), "contiguous"),
])
def test_gemv_refuses_what_it_does_not_do(x: torch.Tensor, w: torch.Tensor, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.gemv(x, w, None)
