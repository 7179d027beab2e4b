"""CPU weight kernels: oneDNN-packed and int8 weight-only Linear against F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from shoal.services.engine.config import ConfigError
from shoal.services.engine.layers.cpu_weights import (Int8Linear, OneDNNLinear, onednn_available,
                                                      prepare_cpu_weights)
from shoal.services.engine.layers.linear import Linear


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_onednn_linear_matches_f_linear(rows: int) -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    w, b = torch.randn(96, 40, generator=gen), torch.randn(96, generator=gen)
    x = torch.randn(rows, 40, generator=gen)
    torch.testing.assert_close(OneDNNLinear(w, b)(x), F.linear(x, w, b), atol=1e-4, rtol=1e-4)


def test_int8_linear_is_its_dequantised_weight_within_bf16_rounding() -> None:
    gen = torch.Generator().manual_seed(torch.seed())
    w = torch.randn(64, 32, generator=gen)
    x = torch.randn(5, 32, generator=gen)
    layer = Int8Linear(w, None)
    assert layer.qweight.dtype == torch.int8 and layer.qweight.abs().max() <= 127
    assert (layer.dequantized() - w).abs().max() <= w.abs().max() / 127  # half a step, bf16 scale
    ref = F.linear(x, layer.dequantized())
    torch.testing.assert_close(layer(x), ref, atol=0.05 * ref.abs().max().item(), rtol=0.02)


@pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")
def test_prepare_releases_dense_weights_and_refuses_unknown_quantization() -> None:
    model = torch.nn.Sequential(Linear(16, 8, bias=True))
    model[0].weight.data.normal_()
    model[0].bias.data.normal_()
    x = torch.randn(3, 16)
    expected = model(x)
    prepare_cpu_weights(model, None)
    assert model[0].kernel is not None and model[0].weight.numel() == 0
    torch.testing.assert_close(model(x), expected, atol=1e-4, rtol=1e-4)
    with pytest.raises(ConfigError):
        prepare_cpu_weights(torch.nn.Sequential(Linear(4, 4)), "fp4")
