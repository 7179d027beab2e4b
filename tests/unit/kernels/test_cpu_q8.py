"""The int8-activation matmuls (csrc/cpu_gguf.cpp: `gguf_matmul_q8`, `int8_matmul_q8`) against
two references: torch over the dequantised weight and the same activation quantisation done
here (int8 blocks of 32, d = max |x| / 127, round half to even), which they must match to float
rounding; and the exact fp32 matmul, which they may miss by the activation quantisation's error
(llama.cpp's, ~0.6 % of the output's norm for Gaussian rows), and a wrong kernel misses by far
more. Every GGUF type they run, 1..17 rows of x (tiles of 4 x-rows, 4 weight rows and their
remainders), on one thread and two."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shoal.kernels import cpu_ops
from tests.unit.kernels.test_cpu_gguf import LAYOUTS, NAMES, random_blocks, theirs

pytestmark = pytest.mark.skipif(not cpu_ops.q8_available(64),
                                reason="no AVX-512 VNNI build of the C++ ops")


def quantised(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """x as the kernels see it: int8 blocks of 32 (256: the K-quant and packed GGUF kernels)
    times their d, fp32 as the C++ code rounds."""
    blocks = x.float().reshape(x.shape[0], -1, block)
    amax = blocks.abs().amax(dim=2, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q = (blocks * inv).round().clamp(-128, 127)
    return (q.double() * (amax / 127.0).double()).reshape(x.shape)


def check(ours: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, block: int = 32) -> None:
    emulated = quantised(x, block) @ weight.double().t()
    scale = emulated.abs().max().item()
    torch.testing.assert_close(ours.double(), emulated, rtol=1e-5, atol=1e-5 * scale)
    exact = x.double() @ weight.double().t()
    assert ((ours.double() - exact).norm() / exact.norm()).item() < 2e-2


@pytest.mark.parametrize("ggml_type", sorted(LAYOUTS), ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", [1, 3, 4, 6, 17])
def test_gguf_q8_matches_the_quantised_activations(threads: int, ggml_type: int, m: int) -> None:
    rows, cols = 37, 768 if LAYOUTS[ggml_type][0] == 256 else 192
    raw = random_blocks(ggml_type, rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    x[0, :32] = 0.0  # a block of zeros (d = 0)
    ours = torch.ops.shoal_cpu.gguf_matmul_q8(x, torch.from_numpy(raw), ggml_type)
    check(ours, x, theirs(raw, ggml_type, rows, cols))


@pytest.mark.parametrize("m", [1, 2, 5, 9])
def test_int8_q8_matches_the_quantised_activations(threads: int, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    qweight = torch.randint(-127, 128, (41, 320), generator=gen, dtype=torch.int8)
    scale = torch.rand(41, generator=gen) * 0.01 + 1e-4
    x = torch.randn(m, 320, generator=gen) * 3.0
    ours = torch.ops.shoal_cpu.int8_matmul_q8(x, qweight, scale)
    check(ours, x, qweight.float() * scale[:, None])


def test_an_outlier_costs_only_its_own_block() -> None:
    """One huge value (LLM activations have them) coarsens its block of 32 only: the output
    stays within the per-block error, unlike a per-row scale."""
    raw = random_blocks(8, 16, 512)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(0))
    x[0, 5] = 500.0
    weight = theirs(raw, 8, 16, 512)
    ours = torch.ops.shoal_cpu.gguf_matmul_q8(x, torch.from_numpy(raw), 8)
    check(ours, x, weight)


def test_refuses_rows_it_cannot_take() -> None:
    raw = torch.from_numpy(random_blocks(8, 4, 96))
    with pytest.raises(RuntimeError, match="multiple of 64"):
        torch.ops.shoal_cpu.gguf_matmul_q8(torch.randn(1, 96), raw, 8)
    with pytest.raises(RuntimeError, match="x \\[M, K\\] fp32"):
        torch.ops.shoal_cpu.gguf_matmul_q8(torch.randn(1, 128, dtype=torch.float64),
                                           torch.from_numpy(random_blocks(8, 4, 128)), 8)
    assert not cpu_ops.q8_available(96)
    np.testing.assert_equal(cpu_ops.q8_available(128), cpu_ops.q8_available(64))


def test_layers_route_small_steps_to_it_against_their_prior_kernels() -> None:
    """Int8Linear at one row and a K-quant GGUFBlockLinear below Q8_MAX_ROWS run the int8 path
    (Q8_0 below MANY_ROWS stays on the float one unless packed: K a multiple of 256), each
    within the activation quantisation's error of the kernel it replaced."""
    from shoal.services.engine.layers.cpu_weights import MANY_ROWS, Int8Linear
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen) * 0.05
    layer = Int8Linear(w, None)
    x = torch.randn(1, 256, generator=gen)
    prior = torch._weight_int8pack_mm(x.to(torch.bfloat16), layer.qweight, layer.scale).float()
    check(layer(x), x, layer.dequantized())
    assert ((layer(x) - prior).norm() / prior.norm()).item() < 2e-2
    for ggml_type in (12, 8):
        raw = torch.from_numpy(random_blocks(ggml_type, 20, 512))
        block_layer = GGUFBlockLinear([(ggml_type, raw)], 512, None)
        for rows in (1, MANY_ROWS, cpu_ops.Q8_MAX_ROWS - 1):
            x = torch.randn(rows, 512, generator=gen)
            prior = torch.ops.shoal_cpu.gguf_matmul(x, raw, ggml_type)
            if ggml_type == 8 and rows < MANY_ROWS and not block_layer.packed[0]:
                torch.testing.assert_close(block_layer(x), prior)
            else:  # packed: activations per 256
                check(block_layer(x), x, block_layer.dequantized(),
                      256 if block_layer.packed[0] else 32)
