"""CPU weight kernels: oneDNN-packed, int8 and int4 Linear against F.linear of the weights they
stand for (the reference dequantised matmul)."""

from __future__ import annotations

import os

import pytest
import torch
from tests.seeding import fresh_generator
import torch.nn.functional as F

from shoal.services.engine.config import ConfigError
from shoal.kernels import cpu_ops
from shoal.services.engine.layers.cpu_weights import (INT4_GROUP, Int4Linear, Int8Linear,
                                                      OneDNNLinear, PanelLinear,
                                                      _per_row_int8,
                                                      dynamic_int8_mm, gemv_available,
                                                      int4_dequantize, keep_plain_weights,
                                                      onednn_available, prepare_cpu_weights)
from shoal.services.engine.layers.embedding import LMHead
from shoal.services.engine.layers.linear import Linear


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_linear_matches_f_linear(rows: int) -> None:
    gen = fresh_generator()
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(OneDNNLinear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_int8_linear_is_its_dequantised_weight_within_bf16_rounding() -> None:
    gen = fresh_generator()
    w = torch.randn(64, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    layer = Int8Linear(w, None)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    assert (layer.dequantized() - w).abs().max() <= w.abs().max() / 127  # half a step, bf16 scale
    ref = F.linear(x, layer.dequantized())
    torch.testing.assert_close(layer(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("cpu_gemv", [False, True])
def test_prepare_moves_dense_weights_to_the_kernel_and_refuses_unknown_quantization(
        cpu_gemv: bool) -> None:
    model = torch.nn.Sequential(Linear(16, 8, bias=True))
    model[0].weight.data.normal_()
    model[0].bias.data.normal_()
    weight = model[0].weight.detach().clone()
    used = prepare_cpu_weights(model, None, cpu_gemv=cpu_gemv)
    kernel = model[0].kernel
    assert isinstance(kernel, OneDNNLinear) and model[0].weight.numel() == 0
    assert (kernel.small is not None) == (cpu_gemv and gemv_available(torch.float32))
    assert ("packed panels (+" in used) == (kernel.small is not None)
    x = torch.randn(cpu_ops.PANEL_MAX_ROWS + 1, 16)
    expected = F.linear(x, weight, model[0].bias)
    for rows in (1, 2, 3, cpu_ops.PANEL_MAX_ROWS, cpu_ops.PANEL_MAX_ROWS + 1):  # panels, oneDNN
        torch.testing.assert_close(model(x[:rows]), expected[:rows], atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError):
        prepare_cpu_weights(torch.nn.Sequential(Linear(4, 4)), "fp4")


@pytest.mark.skipif(not gemv_available(torch.float32), reason="no oneDNN or no C++ compiler")
def test_onednn_linear_runs_small_steps_through_the_panels_and_the_head_has_only_them() -> None:
    gen = fresh_generator()
    w, b = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = OneDNNLinear(w, b, panels=True)
    panels = cpu_ops.dense_pack(w)
    for rows in (1, 2, 8, cpu_ops.PANEL_MAX_ROWS):
        x = torch.randn(rows, 24, generator=gen)
        assert torch.equal(layer(x), cpu_ops.panel_matmul(x, panels, b, 40))
    model = torch.nn.Sequential(Linear(24, 40))
    model.append(LMHead(40, 24, None))
    model[1].weight.data.normal_()
    prepare_cpu_weights(model, None, cpu_gemv=False)
    head = model[1].kernel
    assert isinstance(head, PanelLinear) and not hasattr(head, "packed")
    x = torch.randn(70, 24, generator=gen)  # many rows too (prompt logprobs)
    torch.testing.assert_close(head(x), F.linear(x, model[1].weight), atol=1e-4, rtol=1e-4)


def test_plain_weights_are_kept_when_asked_or_when_they_fit_an_eighth_of_memory() -> None:
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert keep_plain_weights(memory, True) and not keep_plain_weights(1, False)
    assert keep_plain_weights(memory // 8, None) and not keep_plain_weights(memory // 8 + 1, None)


def _rows(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(n, k, generator=gen)


@pytest.mark.parametrize("rows", [1, 5, 16])  # 16: the many-rows kernel (MANY_ROWS)
def test_int8_linear_both_kernels_match_the_dequantised_matmul(rows: int) -> None:
    gen = fresh_generator()
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    x = _rows(rows, 64, gen)
    layer = Int8Linear(w, b)
    ref = F.linear(x, layer.dequantized(), b)
    # bf16 activations (and, from 8 rows, bf16 weights or int8 activations): 2 % of the range
    torch.testing.assert_close(layer(x), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


def test_int4_codes_scales_and_zeros_reproduce_the_weight_within_half_a_step() -> None:
    gen = fresh_generator()
    w = torch.randn(48, 96, generator=gen)
    groups = w.view(48, 3, INT4_GROUP)
    step = (groups.amax(2) - groups.amin(2)) / 15
    codes = ((groups - groups.amin(2, keepdim=True)) / step[..., None]).round().view(48, 96)
    dense = int4_dequantize(codes, step, groups.amin(2) + 8 * step)
    # half a step of rounding, plus fp32 rounding
    assert ((dense - w).abs().view(48, 3, INT4_GROUP) <= step[..., None] / 2 + 1e-5).all()


@pytest.mark.parametrize("rows", [1, 5, 16])  # 1, 5: the int4 kernel; 16: ManyRows
def test_int4_linear_matches_the_reference_dequantised_matmul(rows: int) -> None:
    gen = fresh_generator()
    out_f, in_f = 64, 128
    codes = torch.randint(0, 16, (out_f, in_f), generator=gen)
    step = torch.rand(out_f, in_f // INT4_GROUP, generator=gen) * 0.1 + 0.01
    low = -torch.rand(out_f, in_f // INT4_GROUP, generator=gen)
    b = torch.randn(out_f, generator=gen)
    layer = Int4Linear.from_codes(codes, step, low, b)
    x = _rows(rows, in_f, gen)
    # the reference: w = step * code + low in fp32 (a Q4_1 block's formula)
    ref = F.linear(x, step.repeat_interleave(INT4_GROUP, 1) * codes + low.repeat_interleave(
        INT4_GROUP, 1), b)
    # bf16 scales/zeros and bf16 (ManyRows: or per-row int8) activations: 2 % of the range
    torch.testing.assert_close(layer(x), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)


def test_int4_linear_quantises_a_float_weight_group_wise() -> None:
    gen = fresh_generator()
    w = torch.randn(64, 96, generator=gen)
    layer = Int4Linear(w, None)
    eye = torch.eye(96)
    seen = torch.cat([layer(eye[k:k + 1]) for k in range(96)]).t()  # one row: the int4 kernel
    groups = w.view(64, 3, INT4_GROUP)
    half_step = ((groups.amax(2) - groups.amin(2)) / 30).repeat_interleave(INT4_GROUP, 1)
    # within half a quantisation step of its group, plus bf16 rounding of scale, zero and output
    assert ((seen - w).abs() <= half_step * 1.02 + 0.02).all()
    with pytest.raises(ConfigError):
        Int4Linear(torch.randn(8, 40), None)  # 40 is no multiple of 32


def test_prepare_refuses_gguf_without_a_file() -> None:
    with pytest.raises(ConfigError, match="gguf"):
        prepare_cpu_weights(torch.nn.Sequential(Linear(32, 8)), "gguf")


def test_gguf_blocks_cache_round_trip(tmp_path) -> None:
    """What the cache keeps (each layer's parts as stored, which layers are unquantised) comes
    back as it went in, and a Q4_1 layer from it is the layer of the same blocks: packed where
    AVX-512 VNNI is built, else the int4 layer of the same codes."""
    from shoal.kernels import cpu_ops
    from shoal.services.engine.layers.gguf_weights import (GGUFBlockLinear, _kernel, _read_cache,
                                                           _write_cache)

    gen = fresh_generator()
    model = torch.nn.Sequential(Linear(64, 16, bias=True))
    model[0].bias.data.normal_(generator=gen)
    codes = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.uint8)
    d, m = torch.rand(16, 2, generator=gen), -torch.rand(16, 2, generator=gen)
    blocks = codes.view(16, 2, 32)  # Q4_1: fp16 d, fp16 m, low nibbles 0..15, high 16..31
    raw = torch.cat([d.half().view(torch.uint8).view(16, 2, 2),
                     m.half().view(torch.uint8).view(16, 2, 2),
                     blocks[..., :16] | (blocks[..., 16:] << 4)], dim=2)
    parts = {"0": [(3, raw.reshape(16, 40)), (8, torch.zeros(2, 68, dtype=torch.uint8))]}
    cache = tmp_path / "blocks" / "blocks.safetensors"
    _write_cache(parts, {"lm_head"}, cache)
    back, dense = _read_cache(cache)
    assert dense == {"lm_head"} and [t for t, _ in back["0"]] == [3, 8]
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(back["0"], parts["0"], strict=True))
    layer = _kernel(model[0], back["0"][:1])
    x = torch.randn(3, 64, generator=gen)
    if cpu_ops.packed_available(3, 64):
        assert isinstance(layer, GGUFBlockLinear)
        torch.testing.assert_close(layer(x), _kernel(model[0], parts["0"][:1])(x), atol=0, rtol=0)
        w = (d.half().float().repeat_interleave(32, 1) * codes.float()
             + m.half().float().repeat_interleave(32, 1))
        ref = torch.nn.functional.linear(x, w, model[0].bias)  # within int8 activations' error
        torch.testing.assert_close(layer(x), ref, atol=0.02 * ref.abs().max().item(), rtol=0.02)
    else:
        torch.testing.assert_close(layer(x), Int4Linear.from_codes(
            codes, d.half().float(), m.half().float(), model[0].bias)(x), atol=0, rtol=0)


def test_dynamic_int8_gemm_matches_the_dequantised_matmul() -> None:
    """The many-rows kernel where the CPU has no bf16 GEMM."""
    gen = fresh_generator()
    w, x = torch.randn(96, 64, generator=gen), torch.randn(16, 64, generator=gen)
    qweight, scale = _per_row_int8(w)
    ref = F.linear(x, qweight.float() * scale[:, None])
    # activations quantised per row to int8: 2 % of the output's range
    torch.testing.assert_close(dynamic_int8_mm(x, qweight, scale), ref,
                               atol=0.02 * ref.abs().max().item(), rtol=0.02)
