"""The GGUF block ops (csrc/cpu_gguf.cpp) against the gguf package: random blocks of every type
they run, unpacked exactly as the package dequantises them, and the few-rows matmul and the
many-rows path (bf16 GEMM of the unpacked weight) against torch's matmul over that
dequantisation, with odd shapes (rows not a multiple of the kernel's 4-row tasks, 1..9 rows of x,
more than its 4 rows a pass), on one thread and two."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from shoal.kernels import cpu_ops

pytestmark = pytest.mark.skipif(not cpu_ops.load(), reason="no C++ compiler")

gguf = pytest.importorskip("gguf")

# ggml type id -> (weights a block, bytes a block, byte offsets of its fp16 scales)
LAYOUTS = {2: (32, 18, (0,)), 6: (32, 22, (0,)), 7: (32, 24, (0, 2)), 8: (32, 34, (0,)),
           12: (256, 144, (0, 2)), 13: (256, 176, (0, 2)), 14: (256, 210, (208,)),
           3: (32, 20, (0, 2))}
NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K",
         14: "Q6_K"}


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """Random bytes [rows, row bytes], with finite fp16 scales of a realistic size."""
    qk, size, scales = LAYOUTS[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // qk, size), dtype=np.uint8)
    for offset in scales:
        d = rng.uniform(-0.02, 0.02, (rows, cols // qk)).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // qk, 2)
    return raw.reshape(rows, -1)


def theirs(raw: np.ndarray, ggml_type: int, rows: int, cols: int) -> torch.Tensor:
    dense = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(ggml_type))
    return torch.from_numpy(np.ascontiguousarray(dense, dtype=np.float32).reshape(rows, cols))


def cols_for(ggml_type: int) -> int:
    return 768 if LAYOUTS[ggml_type][0] == 256 else 96  # three blocks of each kind


@pytest.mark.parametrize("ggml_type", sorted(LAYOUTS), ids=lambda t: NAMES[t])
def test_unpacking_is_the_gguf_packages_dequantisation(ggml_type: int) -> None:
    rows, cols = 37, cols_for(ggml_type)
    raw = random_blocks(ggml_type, rows, cols)
    blocks = torch.from_numpy(raw)
    ours = torch.ops.shoal_cpu.gguf_dequantize(blocks, ggml_type, cols, torch.float32)
    torch.testing.assert_close(ours, theirs(raw, ggml_type, rows, cols), rtol=1e-6, atol=1e-7)
    as_bf16 = torch.ops.shoal_cpu.gguf_dequantize(blocks, ggml_type, cols, torch.bfloat16)
    assert torch.equal(as_bf16, ours.to(torch.bfloat16))


@pytest.mark.parametrize("ggml_type", sorted(LAYOUTS), ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", [1, 2, 3, 5, 9])
def test_matmul_matches_torch_over_the_dequantised_weight(threads: int, ggml_type: int,
                                                          m: int) -> None:
    rows, cols = 37, cols_for(ggml_type)
    raw = random_blocks(ggml_type, rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = x @ theirs(raw, ggml_type, rows, cols).t()
    ours = torch.ops.shoal_cpu.gguf_matmul(x, torch.from_numpy(raw), ggml_type)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


@pytest.mark.parametrize("ggml_type", [8, 12, 13, 14], ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", [1, 7, 8, 33])
def test_block_linear_on_both_sides_of_many_rows(ggml_type: int, m: int) -> None:
    """GGUFBlockLinear: a packed layer of two parts in different types (Q4_K_M's q and v), the
    few-rows matmul below MANY_ROWS (int8 activations below Q8_MAX_ROWS where built), the
    unpacked GEMM from there, with a bias."""
    from shoal.services.engine.layers.cpu_weights import MANY_ROWS
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    cols = 512
    first, second = random_blocks(ggml_type, 19, cols), random_blocks(14, 5, cols, seed=1)
    dense = torch.cat([theirs(first, ggml_type, 19, cols), theirs(second, 14, 5, cols)])
    bias = torch.randn(24)
    layer = GGUFBlockLinear([(ggml_type, torch.from_numpy(first)),
                             (14, torch.from_numpy(second))], cols, bias)
    torch.testing.assert_close(layer.dequantized(), dense, rtol=1e-6, atol=1e-7)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = F.linear(x, dense, bias)
    q8 = layer.q8 and m < cpu_ops.Q8_MAX_ROWS
    # int8 activations in blocks of 32, or from MANY_ROWS bf16 weights and activations: 2 %
    tol = 1e-4 if m < MANY_ROWS and not q8 else 2e-2
    torch.testing.assert_close(layer(x), ref, rtol=tol, atol=tol * ref.abs().max().item())


def test_refuses_what_it_cannot_read() -> None:
    raw = torch.from_numpy(random_blocks(12, 4, 256))
    with pytest.raises(RuntimeError, match="multiple of the block size"):
        torch.ops.shoal_cpu.gguf_matmul(torch.randn(1, 128), raw, 12)
    with pytest.raises(RuntimeError, match="do not hold"):
        torch.ops.shoal_cpu.gguf_matmul(torch.randn(1, 512), raw, 12)
    with pytest.raises(RuntimeError, match="unsupported ggml type"):
        torch.ops.shoal_cpu.gguf_matmul(torch.randn(1, 256), raw, 10)  # Q2_K


def test_a_kept_many_rows_copy_is_the_unpacked_weight() -> None:
    """keep_many_rows_copies (when the copies fit in an eighth of memory, as these do): steps
    from Q8_MAX_ROWS rows run the kept copy's GEMM, which matches the per-step unpacking."""
    from shoal.services.engine.layers.cpu_weights import keep_many_rows_copies
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    raw = torch.from_numpy(random_blocks(12, 24, 512))
    fresh = GGUFBlockLinear([(12, raw)], 512, None)
    kept = GGUFBlockLinear([(12, raw)], 512, None)
    assert "kept for it" in keep_many_rows_copies({"a": kept}) and kept.many is not None
    x = torch.randn(33, 512, generator=torch.Generator().manual_seed(0))
    ref = F.linear(x, theirs(raw.numpy(), 12, 24, 512))
    for layer in (fresh, kept):
        torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


def test_unpacking_into_a_reused_buffer_is_the_same() -> None:
    raw = torch.from_numpy(random_blocks(14, 9, 512))
    out = torch.full((9, 512), float("nan"), dtype=torch.bfloat16)
    torch.ops.shoal_cpu.gguf_dequantize_into(raw, 14, out)
    assert torch.equal(out, torch.ops.shoal_cpu.gguf_dequantize(raw, 14, 512, torch.bfloat16))
    with pytest.raises(RuntimeError, match="contiguous \\[N, K\\]"):
        torch.ops.shoal_cpu.gguf_dequantize_into(raw, 14, torch.empty(8, 512))


def test_a_kept_copy_takes_steps_from_kept_from_rows() -> None:
    from shoal.services.engine.layers.gguf_weights import KEPT_FROM_ROWS, GGUFBlockLinear

    raw = torch.from_numpy(random_blocks(12, 8, 256))
    layer = GGUFBlockLinear([(12, raw)], 256, None)
    layer.keep_many_rows()
    calls = []
    many = layer.many
    layer.many = lambda x: calls.append(x.shape[0]) or many(x)  # type: ignore[assignment]
    for rows in (1, KEPT_FROM_ROWS - 1, KEPT_FROM_ROWS, 20):
        layer(torch.randn(rows, 256))
    assert calls == [KEPT_FROM_ROWS, 20]


Q8K_TYPES = [12, 14]
"""Types `gguf_matmul_q8k` runs (activations per 256, scales applied in integers)."""


def q8k_built() -> bool:
    return hasattr(torch.ops.shoal_cpu, "gguf_matmul_q8k")


@pytest.mark.skipif(not q8k_built(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("ggml_type", Q8K_TYPES, ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("shape", [(37, 768), (1, 256), (17, 2048)], ids=str)
def test_q8k_is_exact_on_activations_int8_holds_exactly(threads: int, ggml_type: int, m: int,
                                                        shape: tuple[int, int]) -> None:
    """Activations that are whole numbers with a 127 in every 256 quantise without error, so
    the kernel must give the dequantised matmul to float rounding: a wrong nibble, scale, min
    or sum order shows up here, not hidden in quantisation noise."""
    rows, cols = shape
    raw = random_blocks(ggml_type, rows, cols, seed=m)
    gen = torch.Generator().manual_seed(m)
    x = torch.randint(-127, 128, (m, cols), generator=gen).float()
    x[:, ::256] = 127.0
    ref = x.double() @ theirs(raw, ggml_type, rows, cols).double().t()
    ours = torch.ops.shoal_cpu.gguf_matmul_q8k(x, torch.from_numpy(raw), ggml_type)
    torch.testing.assert_close(ours.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.skipif(not q8k_built(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize("ggml_type", Q8K_TYPES, ids=lambda t: NAMES[t])
@pytest.mark.parametrize("m", [1, 2, 7])
def test_q8k_matches_torch_within_int8_activation_error(threads: int, ggml_type: int,
                                                        m: int) -> None:
    rows, cols = 37, 1024
    raw = random_blocks(ggml_type, rows, cols, seed=m)
    x = torch.randn(m, cols, generator=torch.Generator().manual_seed(m))
    ref = x @ theirs(raw, ggml_type, rows, cols).t()
    ours = torch.ops.shoal_cpu.gguf_matmul_q8k(x, torch.from_numpy(raw), ggml_type)
    torch.testing.assert_close(ours, ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not q8k_built(), reason="needs AVX-512 VNNI")
def test_q8k_refuses_other_types() -> None:
    with pytest.raises(RuntimeError, match="Q4_K \\(12\\) or Q6_K"):
        torch.ops.shoal_cpu.gguf_matmul_q8k(torch.randn(1, 256),
                                            torch.from_numpy(random_blocks(8, 4, 256)), 8)


def packed_built() -> bool:
    return hasattr(torch.ops.shoal_cpu, "gguf_repack")


PACKED_BYTES = {12: 2368, 14: 3360, 8: 544, 3: 320}
"""A group of 16 rows' (super-)block, or block of 32, in the packed layout, by ggml type."""
PACKED_CASES = [(t, shape, 256) for t in (8, 12, 14)
                for shape in [(37, 768), (16, 256), (5, 2048), (1, 512)]] + [
               (t, shape, 32) for t in (3, 8)
               for shape in [(37, 96), (16, 576), (5, 1536), (1, 32), (49, 608)]]
"""(ggml type, weight shape, activations quantised per): Q4_K, Q6_K and Q8_0 with K a multiple
of 256 take activations per 256; Q4_1 (any K a multiple of 32, SmolLM2's 576) and Q8_0 of a K
no multiple of 256 (SmolLM2's LM head) per 32."""


@pytest.mark.skipif(not packed_built(), reason="needs AVX-512 VNNI")
@pytest.mark.parametrize(("ggml_type", "shape", "per"), PACKED_CASES,
                         ids=lambda v: NAMES[v] if isinstance(v, int) and v in NAMES else str(v))
def test_packed_round_trips_and_is_exact_on_int8_activations(
        threads: int, ggml_type: int, shape: tuple[int, int], per: int) -> None:
    """Repacked 16 rows at a time (rows past N padded): unpacking gives the stored bytes back
    bit for bit; on activations int8 holds exactly (each block of `per` reaching 127) the packed
    matmul is the dequantised matmul for N not a multiple of 16 and 1..9 rows of x (passes of
    4); on random activations within int8's error."""
    rows, cols = shape
    raw = random_blocks(ggml_type, rows, cols, seed=rows)
    blocks = torch.from_numpy(raw)
    packed = torch.ops.shoal_cpu.gguf_repack(blocks, ggml_type)
    qk = LAYOUTS[ggml_type][0]
    assert packed.shape == ((rows + 15) // 16, cols // qk * PACKED_BYTES[ggml_type])
    assert torch.equal(torch.ops.shoal_cpu.gguf_unrepack(packed, ggml_type, rows), blocks)
    dense = theirs(raw, ggml_type, rows, cols).double()
    for m in range(1, 10):
        x = torch.randint(-127, 128, (m, cols), generator=torch.Generator().manual_seed(m)).float()
        x[:, ::per] = 127.0
        ref = x.double() @ dense.t()
        ours = torch.ops.shoal_cpu.gguf_matmul_packed(x, packed, ggml_type, rows)
        torch.testing.assert_close(ours.double(), ref, rtol=1e-5,
                                   atol=1e-5 * ref.abs().max().item())
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(0))
    ref = x @ dense.float().t()
    torch.testing.assert_close(torch.ops.shoal_cpu.gguf_matmul_packed(x, packed, ggml_type, rows),
                               ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not packed_built(), reason="needs AVX-512 VNNI")
def test_q4_1_layers_run_packed_with_every_path_the_files() -> None:
    """A Q4_1 layer (SmolLM2's q/k/v stacked, K = 576) runs as a packed GGUFBlockLinear: few
    rows through the packed kernel, many through the unpacked GEMM, both the file's weight."""
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    q, kv = random_blocks(3, 64, 576), random_blocks(3, 40, 576, seed=1)
    layer = GGUFBlockLinear([(3, torch.from_numpy(q)), (3, torch.from_numpy(kv))], 576, None)
    assert layer.packed == [True] and layer.rows == [104]  # one matmul for both parts
    dense = torch.cat([theirs(q, 3, 64, 576), theirs(kv, 3, 40, 576)])
    assert torch.equal(layer.dequantized(), dense)
    for m in (1, 4, 9, 40):
        x = torch.randn(m, 576, generator=torch.Generator().manual_seed(m))
        ref = x @ dense.t()
        torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())


@pytest.mark.skipif(not packed_built(), reason="needs AVX-512 VNNI")
def test_packed_refuses_a_mismatched_shape() -> None:
    packed = torch.ops.shoal_cpu.gguf_repack(torch.from_numpy(random_blocks(12, 20, 512)), 12)
    with pytest.raises(RuntimeError, match="ceil\\(N / 16\\)"):
        torch.ops.shoal_cpu.gguf_matmul_packed(torch.randn(1, 512), packed, 12, 40)
    with pytest.raises(RuntimeError, match="K the packed weight's"):
        torch.ops.shoal_cpu.gguf_matmul_packed(torch.randn(1, 256), packed, 12, 20)
    with pytest.raises(RuntimeError, match="Q4_K \\(12\\), Q6_K \\(14\\), Q8_0 \\(8\\) or Q4_1"):
        torch.ops.shoal_cpu.gguf_repack(torch.from_numpy(random_blocks(2, 4, 256)), 2)
    packed = torch.ops.shoal_cpu.gguf_repack(torch.from_numpy(random_blocks(3, 4, 96)), 3)
    with pytest.raises(RuntimeError, match="K the packed weight's"):  # Q4_1: K = 96
        torch.ops.shoal_cpu.gguf_matmul_packed(torch.randn(1, 64), packed, 3, 4)


@pytest.mark.skipif(not packed_built(), reason="needs AVX-512 VNNI")
def test_block_linear_keeps_packed_parts_only() -> None:
    """A GGUF layer holds its Q4_K, Q6_K and Q8_0 parts packed (not beside the stored bytes)
    and its Q5_K part as stored; every path (few rows, many rows) and the dequantised weight
    are the file's."""
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    q4k, q6k = random_blocks(12, 21, 512), random_blocks(14, 5, 512, seed=1)
    q80, q5k = random_blocks(8, 3, 512, seed=2), random_blocks(13, 4, 512, seed=3)
    layer = GGUFBlockLinear([(12, torch.from_numpy(q4k)), (14, torch.from_numpy(q6k)),
                             (8, torch.from_numpy(q80)), (13, torch.from_numpy(q5k))], 512, None)
    assert layer.packed == [True, True, True, False] and layer.rows == [21, 5, 3, 4]
    assert layer.parts[0][1].shape == (2, 2 * 2368) and layer.parts[1][1].shape == (1, 2 * 3360)
    assert layer.parts[2][1].shape == (1, 16 * 544)
    dense = torch.cat([theirs(q4k, 12, 21, 512), theirs(q6k, 14, 5, 512),
                       theirs(q80, 8, 3, 512), theirs(q5k, 13, 4, 512)])
    assert torch.equal(layer.dequantized(), dense)
    assert layer.dense_numel() == 33 * 512
    small = GGUFBlockLinear([(13, torch.from_numpy(random_blocks(13, 3, 256)))], 256, None)
    assert small.packed == [False]  # Q5_K: stored, the int8 path
    for m in (1, 9, 40):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        ref = x @ dense.t()
        torch.testing.assert_close(layer(x), ref, rtol=2e-2, atol=2e-2 * ref.abs().max().item())
