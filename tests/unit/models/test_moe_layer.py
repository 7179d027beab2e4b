"""The fused MoE layer (layers/moe.py) against a per-token reference loop: routing (softmax, top-k,
renormalised or not), grouped experts for one token and for many, a shared expert with its
sigmoid gate; checkpoint names of both layouts; CPU kernels (oneDNN, int8, int4) per expert; and
the engine's int8 / int4 paths running a tiny Qwen3-MoE."""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.layers.cpu_weights import prepare_cpu_weights
from shoal.services.engine.layers.moe import FusedMoE, expert_target, route, silu_and_mul
from shoal.services.engine.models.llama import LlamaMLP
from shoal.services.engine.models.moe_models import MIXTRAL_PROJECTIONS, QWEN_PROJECTIONS
from shoal.services.engine.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, save_tiny_model

HIDDEN, INTER, EXPERTS, TOP_K = 32, 64, 6, 2


class _Cfg:
    hidden_size, intermediate_size = HIDDEN, 96


def _moe(renormalize: bool, shared: bool, seed: int = 0) -> FusedMoE:
    torch.manual_seed(seed)
    layer = FusedMoE(EXPERTS, TOP_K, HIDDEN, INTER, renormalize, ParallelContext.single(),
                     LlamaMLP(_Cfg(), False, ParallelContext.single()) if shared else None)
    for p in layer.parameters():
        p.data.normal_(0, 0.3)
    return layer


def _reference(layer: FusedMoE, x: torch.Tensor) -> torch.Tensor:
    """One token at a time, one expert at a time (transformers' arithmetic)."""
    probs = torch.softmax(F.linear(x, layer.gate.weight), -1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(TOP_K)
        weights = top.values / top.values.sum() if layer.renormalize else top.values
        for w, e in zip(weights, top.indices.tolist()):
            gate, up = F.linear(x[t], layer.experts.w13[e]).chunk(2)
            out[t] += w * F.linear(F.silu(gate) * up, layer.experts.w2[e])
    if layer.shared_expert is not None and layer.shared_expert_gate is not None:
        out += torch.sigmoid(F.linear(x, layer.shared_expert_gate.weight)) * layer.shared_expert(x)
    return out


@pytest.mark.parametrize("renormalize, shared", [(True, False), (False, True)])
@pytest.mark.parametrize("tokens", [1, 2, 37])
def test_grouped_experts_match_the_per_token_loop(renormalize: bool, shared: bool,
                                                  tokens: int) -> None:
    layer = _moe(renormalize, shared)
    x = torch.randn(tokens, HIDDEN)
    with torch.no_grad():
        torch.testing.assert_close(layer(x), _reference(layer, x), atol=1e-5, rtol=1e-5)


def test_route_renormalises_the_top_k_of_the_softmax() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    weights, ids = route(logits, 2, renormalize=False)
    probs = torch.softmax(logits, -1)[0]
    assert ids.tolist() == [[3, 2]]
    torch.testing.assert_close(weights[0], probs[[3, 2]])
    weights, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(weights.sum(), torch.tensor(1.0))


def test_checkpoint_names_of_both_layouts_map_to_the_stacked_experts() -> None:
    assert expert_target("model.layers.3.mlp.experts.17.up_proj.weight", QWEN_PROJECTIONS) == (
        "model.layers.3.mlp.experts.w13", (17, "up"))
    assert expert_target("model.layers.0.mlp.experts.2.w2.weight", MIXTRAL_PROJECTIONS) == (
        "model.layers.0.mlp.experts.w2", (2, "down"))
    assert expert_target("model.layers.0.mlp.experts.gate_up_proj", QWEN_PROJECTIONS) == (
        "model.layers.0.mlp.experts.w13", (None, "gate_up"))
    assert expert_target("model.layers.0.mlp.gate.weight", QWEN_PROJECTIONS) is None
    assert expert_target("model.layers.0.mlp.shared_expert.up_proj.weight",
                         QWEN_PROJECTIONS) is None


def test_stacked_and_per_expert_checkpoints_load_the_same_weights() -> None:
    source = _moe(True, False).experts
    per_expert = _moe(True, False, seed=1).experts
    stacked = _moe(True, False, seed=2).experts
    for e in range(EXPERTS):
        gate, up = source.w13[e].split(INTER)
        per_expert.w13.weight_loader(per_expert.w13, gate, (e, "gate"))
        per_expert.w13.weight_loader(per_expert.w13, up, (e, "up"))
        per_expert.w2.weight_loader(per_expert.w2, source.w2[e], (e, "down"))
    stacked.w13.weight_loader(stacked.w13, source.w13.data.clone(), (None, "gate_up"))
    stacked.w2.weight_loader(stacked.w2, source.w2.data.clone(), (None, "down"))
    for layer in (per_expert, stacked):
        assert torch.equal(layer.w13, source.w13) and torch.equal(layer.w2, source.w2)


@pytest.mark.parametrize("quantization, tolerance", [(None, 1e-4), ("int8", 0.05),
                                                     ("int4", 0.15)])
def test_each_expert_gets_the_cpu_kernels_of_a_linear(quantization: str | None,
                                                      tolerance: float) -> None:
    from shoal.kernels import cpu_ops

    layer = _moe(True, True)
    x = torch.randn(9, HIDDEN)
    with torch.no_grad():
        expected = _reference(layer, x)
        prepare_cpu_weights(torch.nn.Sequential(layer), quantization)
        assert layer.experts.kernels is not None and len(layer.experts.kernels) == EXPERTS
        assert layer.experts.w13.numel() == 0 and layer.gate.weight.numel() > 0  # router kept
        # fp32 keeps its stacks packed for moe_forward (a step of up to MOE_MAX_ROWS tokens)
        assert (layer.experts.packed is not None) == (quantization is None)
        for rows, limit in ((1, None), (9, None), (9, 0)):  # (0: each expert's own kernels)
            with pytest.MonkeyPatch.context() as patch:
                if limit is not None:
                    patch.setattr(cpu_ops, "MOE_MAX_ROWS", limit)
                got = layer(x[:rows])
            scale = expected[:rows].abs().max().item()
            torch.testing.assert_close(got, expected[:rows], atol=tolerance * scale,
                                       rtol=tolerance)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_the_engine_runs_a_quantised_moe(quantization: str,
                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    folder = save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("qmoe"), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(0)).tolist()
    with LLM(str(folder), device="cpu", dtype="float32", num_kv_blocks=64,
             quantization=quantization) as llm:
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert f"{quantization} weights" in llm.engine.runner.settings
    assert len(out.outputs[0].token_ids) == 8


def test_moe_pack_lays_out_k_major_panels_with_gate_and_up_side_by_side() -> None:
    """cpu_ops.moe_pack: w13 panel b holds gate rows 16b.. in lanes 0-15 and the same up rows in
    lanes 16-31, w2 panel b down rows 32b..; k-major, zeros past the last row (21 and 37 rows:
    neither a multiple of a panel)."""
    from shoal.kernels import cpu_ops

    experts, inter, hidden = 3, 21, 37
    w13, w2 = torch.randn(experts, 2 * inter, hidden), torch.randn(experts, hidden, inter)
    p13, p2 = cpu_ops.moe_pack(w13, w2)
    assert p13.shape == (experts, 2, hidden, 32) and p2.shape == (experts, 2, inter, 32)
    assert p13.is_contiguous() and p2.is_contiguous()
    for e in range(experts):
        for j in range(32):  # gate / up row j of expert e: panel j // 16, lane j % 16 (+ 16)
            want = (w13[e, j], w13[e, inter + j]) if j < inter else (torch.zeros(hidden),) * 2
            assert torch.equal(p13[e, j // 16, :, j % 16], want[0])
            assert torch.equal(p13[e, j // 16, :, 16 + j % 16], want[1])
        for j in range(64):
            want2 = w2[e, j] if j < hidden else torch.zeros(inter)
            assert torch.equal(p2[e, j // 32, :, j % 32], want2)


@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 17, 64, 100])
@pytest.mark.parametrize("variant", ["qwen", "softmax-first", "gpt-oss"])
def test_moe_forward_matches_the_torch_path(tokens: int, variant: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """cpu_ops.moe_forward (the whole layer in one C++ call) against the same layer's torch
    path: widths that are not multiples of the kernel's vector or row block, 1..64 rows (experts
    with one row and with many), renormalised or not, gpt-oss's biases, router bias, top-k-first
    and clamped SwiGLU, and a shared expert added outside."""
    from shoal.kernels import cpu_ops
    from shoal.services.engine.layers.activation import ClampedSwiGLU

    monkeypatch.setattr(cpu_ops, "MOE_MAX_ROWS", 128)  # the kernel past the rows it is used for
    assert cpu_ops.load()
    gpt_oss = variant == "gpt-oss"
    torch.manual_seed(tokens)
    layer = FusedMoE(5, 3 if gpt_oss else 2, 37, 21, variant == "qwen", ParallelContext.single(),
                     None if gpt_oss else LlamaMLP(_Cfg37(), False, ParallelContext.single()),
                     bias=gpt_oss, activation=ClampedSwiGLU(1.702, 1.5) if gpt_oss
                     else silu_and_mul, topk_first=gpt_oss)
    for p in layer.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(tokens, 37)
    with torch.no_grad():
        expected = layer(x)  # packed unset: the torch path
        layer.experts.packed = cpu_ops.moe_pack(layer.experts.w13.data, layer.experts.w2.data)
        assert layer.fused(x) is not None
        # fp32 sums in another order (one lane per output, k in sequence): rounding relative
        # to the layer's largest outputs (tens here), not to a cancelled one near zero
        scale = expected.abs().max().item()
        torch.testing.assert_close(layer(x), expected, atol=1e-6 * scale, rtol=1e-5)


class _Cfg37:
    hidden_size, intermediate_size = 37, 19
