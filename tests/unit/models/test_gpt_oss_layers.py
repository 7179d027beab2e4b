"""gpt-oss's pieces against transformers' own modules: the MoE layer (biased router, top-k then
softmax, biased experts, the clamped SwiGLU, the interleaved [E, in, out] checkpoint layout) on
the torch path and on the CPU kernels; MXFP4 dequantisation against transformers' mxfp4
integration; an MXFP4 pair loads in either order to the dense layout's weights."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.layers import mxfp4
from shoal.services.engine.layers.cpu_weights import prepare_cpu_weights
from shoal.services.engine.layers.moe import FusedMoE, gpt_oss_expert_target
from shoal.services.engine.models.gpt_oss import GptOssForCausalLM, gpt_oss_mlp
from tests.tiny_models import mxfp4_quantize

CFG = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=5,
                   num_experts_per_tok=2, swiglu_limit=1.5, num_hidden_layers=1)


def _pair(seed: int = 0) -> tuple[GptOssMLP, FusedMoE]:
    """transformers' MLP with random weights (biases and all), and ours loaded from its
    state dict through the checkpoint names a gpt-oss checkpoint uses."""
    torch.manual_seed(seed)
    theirs = GptOssMLP(CFG).eval()
    with torch.no_grad():
        for param in theirs.parameters():
            param.normal_(0.0, 0.5)
    ours = gpt_oss_mlp(CFG, 0, ParallelContext.single())
    params = dict(ours.named_parameters())
    model = GptOssForCausalLM.__new__(GptOssForCausalLM)  # its name mapping only
    for name, tensor in theirs.state_dict().items():
        target, shard = model.checkpoint_target(f"model.layers.0.mlp.{name}") or (name, None)
        param = params[target.removeprefix("model.layers.0.mlp.")]
        loader = param.weight_loader  # type: ignore[attr-defined]
        loader(param, tensor) if shard is None else loader(param, tensor, shard)
    return theirs, ours


@pytest.mark.parametrize("tokens", [1, 9])
@pytest.mark.parametrize("kernels", [False, True])
def test_moe_layer_matches_transformers(tokens: int, kernels: bool) -> None:
    theirs, ours = _pair()
    if kernels:  # each expert's two matmuls (with their biases) on the CPU kernels
        prepare_cpu_weights(ours, None)
        assert ours.experts.kernels is not None
    x = torch.randn(tokens, CFG.hidden_size) * 2
    with torch.no_grad():
        expected, _ = theirs(x[None])
        got = ours(x)
    torch.testing.assert_close(got, expected[0], atol=1e-5, rtol=1e-5)
    clamped = ours.experts.activation(torch.full((1,), 9.0), torch.full((1,), -9.0))
    assert torch.allclose(clamped, torch.tensor((1 - 1.5) * 1.5 * torch.sigmoid(
        torch.tensor(1.5 * 1.702)).item()))  # gate and up clamped to the limit


def test_expert_names_map_for_both_layouts() -> None:
    prefix = "model.layers.3.mlp.experts"
    assert gpt_oss_expert_target(f"{prefix}.gate_up_proj") == (f"{prefix}.w13",
                                                               (None, "gate_up", "transposed"))
    assert gpt_oss_expert_target(f"{prefix}.down_proj_bias") == (f"{prefix}.w2_bias",
                                                                 (None, "down", "bias"))
    assert gpt_oss_expert_target(f"{prefix}.gate_up_proj_scales") == (
        f"{prefix}.w13", (None, "gate_up", "scales"))
    assert gpt_oss_expert_target("model.layers.3.mlp.router.weight") is None


def test_mxfp4_dequantize_matches_transformers() -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 10, 4, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(110, 140, (3, 10, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 128, 10]
    torch.testing.assert_close(mxfp4.dequantize(blocks, scales), theirs.transpose(1, 2),
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not match"):
        mxfp4.dequantize(blocks, scales[..., :3])


@pytest.mark.parametrize("scales_first", [False, True])
def test_an_mxfp4_pair_loads_as_the_dense_layout(scales_first: bool) -> None:
    """Blocks and scales (either first) dequantise to what the bf16 layout of the same values
    loads: [E, in, out] transposed, gate/up de-interleaved."""
    theirs, dense = _pair()
    _, packed = _pair(seed=1)
    for proj, ours_name in (("gate_up_proj", "w13"), ("down_proj", "w2")):
        weight = getattr(theirs.experts, proj).data  # [E, in, out]
        blocks, scales = mxfp4_quantize(weight.transpose(1, 2))
        rounded = mxfp4.dequantize(blocks, scales).transpose(1, 2)
        part = "gate_up" if proj == "gate_up_proj" else "down"
        for model, tensors in ((dense, [(rounded, "transposed")]),
                               (packed, [(blocks, "blocks"), (scales, "scales")])):
            param = getattr(model.experts, ours_name)
            for tensor, kind in (tensors[::-1] if scales_first else tensors):
                param.weight_loader(param, tensor, (None, part, kind))  # type: ignore[attr-defined]
    assert torch.equal(packed.experts.w13, dense.experts.w13)
    assert torch.equal(packed.experts.w2, dense.experts.w2)
    assert not packed.experts._mxfp4  # nothing left waiting for a partner
