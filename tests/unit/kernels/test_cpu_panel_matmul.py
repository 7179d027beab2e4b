"""The packed small-rows matmul (`panel_matmul` over `dense_pack`'s panels, csrc/cpu_moe.cpp)
against torch's matmul in float64: every row count 1..16 and a few past its 8-row register chunk,
output and input sizes that are not multiples of its panel (32) or vector (16), with and without
a bias, on one thread and split across two; what it refuses it refuses with a clear error."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tests.seeding import fresh_generator

from shoal.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x.double(), w.double(), None if b is None else b.double()).float()


@pytest.mark.parametrize("rows", [*range(1, 17), 23])
@pytest.mark.parametrize(("n", "k"), [(96, 40), (5, 3), (577, 1537), (33, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_matmul_matches_torch(threads: int, rows: int, n: int, k: int, bias: bool) -> None:
    gen = fresh_generator()
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(rows, k, generator=gen)
    packed = cpu_ops.dense_pack(w)
    assert packed.shape == (-(-n // 32), k, 32)
    out = cpu_ops.panel_matmul(x, packed, b, n)
    assert out.shape == (rows, n) and out.dtype == torch.float32
    torch.testing.assert_close(out, reference(x, w, b), atol=1e-4 * k ** 0.5, rtol=1e-4)


def test_panel_matmul_of_no_rows_is_empty_and_a_strided_x_is_the_same() -> None:
    w = torch.randn(40, 48)
    packed = cpu_ops.dense_pack(w)
    assert cpu_ops.panel_matmul(torch.randn(0, 48), packed, None, 40).shape == (0, 40)
    x = torch.randn(3, 96)[:, ::2]  # a view, as a step's hidden state may be
    assert torch.equal(cpu_ops.panel_matmul(x, packed, None, 40),
                       cpu_ops.panel_matmul(x.contiguous(), packed, None, 40))


@pytest.mark.parametrize(("x", "n", "message"), [
    (torch.randn(2, 7), 40, r"x must be \[M, K\]"),
    (torch.randn(2, 8), 70, "packed float32 weight"),
])
def test_panel_matmul_refuses_what_it_does_not_do(x: torch.Tensor, n: int, message: str) -> None:
    with pytest.raises(RuntimeError, match=message):
        cpu_ops.panel_matmul(x, cpu_ops.dense_pack(torch.randn(40, 8)), None, n)


def test_a_rows_result_does_not_depend_on_the_rows_beside_it(threads: int) -> None:
    """Each row's sums run in the same order whatever the step's row count (its register chunk
    or thread split): a sequence's fp32 logits are bit-identical at batch 1 and batch 32."""
    gen = fresh_generator()
    packed = cpu_ops.dense_pack(torch.randn(577, 1537, generator=gen))
    x = torch.randn(cpu_ops.PANEL_MAX_ROWS, 1537, generator=gen)
    alone = torch.cat([cpu_ops.panel_matmul(x[m:m + 1], packed, None, 577) for m in range(len(x))])
    for rows in (2, 5, 8, 9, 17, cpu_ops.PANEL_MAX_ROWS):
        assert torch.equal(cpu_ops.panel_matmul(x[:rows], packed, None, 577), alone[:rows])
