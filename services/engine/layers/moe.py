"""Mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per token.

Why fused: on a CPU a token reads only its experts' weights, so an MoE decodes at about the speed
of a dense model of its active size, if the step runs each expert once over all of its tokens.
`FusedMoE` sorts the step's (token, expert) pairs by expert id, gathers the rows with one
`index_select`, runs each active expert's gate/up and down matmuls once on its contiguous rows,
scales them by the routing weights and scatters them back with one `index_add_` (the loop is over
the experts a step uses, never over tokens). The experts' weights are stacked, `w13`
[experts, 2 * inter, hidden] (gate rows, then up rows) and `w2` [experts, hidden, inter];
cpu_weights.py gives each expert its CPU kernels (oneDNN / GEMV, int8, int4) as it does a Linear.

Routing is transformers' (Qwen2/3-MoE, Mixtral, OLMoE): softmax over the router logits in
float32, top-k, then renormalised to sum to 1 when `norm_topk_prob` (Mixtral always); gpt-oss's
(`topk_first`): top-k of the (biased) router logits, then a softmax over those k.

gpt-oss's experts differ in three ways, each an option here rather than a copy: biases on both
projections (`bias`: the down bias held by tp rank 0 only, as RowParallelLinear's), its clamped
SwiGLU (`activation`, layers/activation.py), and its checkpoint layout, [experts, in, out] with
gate and up interleaved (`gate_up_proj` [E, hidden, 2 * inter]: column 2i is gate i, 2i + 1 up
i), or MXFP4 `_blocks` / `_scales` pairs (layers/mxfp4.py), dequantised when both have arrived.

Tensor parallel as the dense MLP (Megatron): each rank holds every expert's slice of the
intermediate size (gate/up rows, down columns); the router is replicated; the ranks' partial sums
meet in one all-reduce. Checkpoints store experts one tensor per expert and projection
(`experts.<e>.gate_proj.weight`, Mixtral's `w1`/`w3`/`w2`) or, as transformers >= 5 may save
them, stacked (`experts.gate_up_proj`, `experts.down_proj`): `expert_target` maps both.
"""

from __future__ import annotations

import re
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext
from shoal.services.engine.layers import mxfp4
from shoal.services.engine.layers.activation import ClampedSwiGLU
from shoal.services.engine.layers.linear import default_weight_loader

Kernel = Callable[[torch.Tensor], torch.Tensor]

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_GPT_OSS = re.compile(
    r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)(?P<kind>|_bias|_blocks|_scales)$")


def expert_target(name: str, projections: dict[str, str]) -> tuple[str, tuple] | None:
    """A checkpoint name of an expert weight -> (our parameter, shard id), else None.
    `projections`: the checkpoint's projection names -> "gate" / "up" / "down"."""
    if m := _PER_EXPERT.match(name):
        part = projections.get(m["proj"])
        if part is None:
            return None
        return f"{m['prefix']}.{'w2' if part == 'down' else 'w13'}", (int(m["expert"]), part)
    if m := _STACKED.match(name):
        part = "gate_up" if m["proj"] == "gate_up_proj" else "down"
        return f"{m['prefix']}.{'w2' if part == 'down' else 'w13'}", (None, part)
    return None


def gpt_oss_expert_target(name: str) -> tuple[str, tuple] | None:
    """gpt-oss's expert tensors (bf16 [E, in, out] with gate/up interleaved, their biases, or
    MXFP4 blocks / scales) -> (our parameter, shard id)."""
    if not (m := _GPT_OSS.match(name)):
        return None
    part = "gate_up" if m["proj"] == "gate_up_proj" else "down"
    kind = m["kind"] or "_transposed"
    param = ("w2" if part == "down" else "w13") + ("_bias" if kind == "_bias" else "")
    return f"{m['prefix']}.{param}", (None, part, kind[1:])


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k]).
    Renormalised, the top-k of the softmax is the softmax over the top-k logits (the full
    denominator cancels): two ops a layer instead of five, in float32 as transformers'."""
    if renormalize:
        values, ids = torch.topk(logits, top_k, dim=-1)
        return torch.softmax(values, dim=-1, dtype=torch.float32).to(logits.dtype), ids
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return weights.to(logits.dtype), ids


def route_topk_first(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """gpt-oss: the top-k logits, then a softmax over them (weights in the logits' dtype)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


Activation = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(gate, up) -> the expert's hidden activation."""


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class StackedExperts(nn.Module):
    """Every expert's gated MLP, this rank's slice of each (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelContext, bias: bool = False,
                 activation: Activation = silu_and_mul) -> None:
        super().__init__()
        self.parallel = parallel
        self.activation = activation
        self.num_experts = num_experts
        self.inter_total = intermediate_size
        self.inter = intermediate_size // parallel.tp_size  # this rank's slice
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter),
                               requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if bias:  # [E, 2 * inter] (gate, then up) and [E, hidden] (zeros but on tp rank 0)
            self.w13_bias = nn.Parameter(torch.zeros(num_experts, 2 * self.inter),
                                         requires_grad=False)
            self.w2_bias = nn.Parameter(torch.zeros(num_experts, hidden_size),
                                        requires_grad=False)
            self.w13_bias.weight_loader = self._load_w13_bias  # type: ignore[attr-defined]
            self.w2_bias.weight_loader = self._load_w2_bias  # type: ignore[attr-defined]
        self._mxfp4: dict[str, dict[str, torch.Tensor]] = {}
        """Per projection, the MXFP4 blocks or scales read before their partner."""
        self.kernels: list[tuple[Kernel, Kernel]] | None = None
        """Per expert, its (gate/up, down) CPU kernels, set after loading (cpu_weights.py)."""
        self.packed: tuple[torch.Tensor, torch.Tensor] | None = None
        """(w13, w2) packed by `cpu_ops.moe_pack` where the CPU kernels would keep plain float32
        weights for the GEMV (it replaces those plain stacks): a step of up to MOE_MAX_ROWS
        tokens then runs the whole layer as one `cpu_ops.moe_forward` (FusedMoE.fused)."""

    def _rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a tensor whose `dim` is the full intermediate size."""
        assert loaded.shape[dim] == self.inter_total, (tuple(loaded.shape), self.inter_total)
        return loaded.narrow(dim, self.parallel.tp_rank * self.inter, self.inter)

    def _stacked(self, loaded: torch.Tensor, shard: tuple) -> torch.Tensor | None:
        """A whole stack in gpt-oss's layout -> [E, out, in] with gate rows before up rows;
        None while an MXFP4 tensor waits for its partner. Other layouts pass unchanged."""
        kind = shard[2] if len(shard) > 2 else ""
        if kind in ("blocks", "scales"):
            pending = self._mxfp4.setdefault(shard[1], {})
            pending[kind] = loaded
            if len(pending) < 2:
                return None
            del self._mxfp4[shard[1]]
            loaded = mxfp4.dequantize(pending["blocks"], pending["scales"])  # [E, out, in]
        elif kind == "transposed":  # [E, in, out]
            loaded = loaded.transpose(1, 2)
        if kind and shard[1] == "gate_up":  # rows interleaved: gate 0, up 0, gate 1, ...
            loaded = torch.cat([loaded[:, 0::2], loaded[:, 1::2]], dim=1)
        return loaded

    def unpaired(self) -> list[str]:
        """The MXFP4 halves read without their partner (the loader refuses such a checkpoint)."""
        return [f"{part}_proj_{'scales' if 'blocks' in got else 'blocks'}"
                for part, got in self._mxfp4.items()]

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert, part = shard[:2]
        if expert is None:  # stacked [E, 2 * inter, hidden]: gate rows, then up rows
            if (stacked := self._stacked(loaded, shard)) is None:
                return
            loaded = stacked
            gate, up = loaded.split(self.inter_total, dim=1)
            param.data[:, :self.inter].copy_(self._rows(gate, 1))
            param.data[:, self.inter:].copy_(self._rows(up, 1))
            return
        offset = 0 if part == "gate" else self.inter
        param.data[expert, offset:offset + self.inter].copy_(self._rows(loaded, 0))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert = shard[0]
        if expert is None:  # stacked [E, hidden, inter]
            if (stacked := self._stacked(loaded, shard)) is not None:
                param.data.copy_(self._rows(stacked, 2))
        else:
            param.data[expert].copy_(self._rows(loaded, 1))

    def _load_w13_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        gate, up = loaded[:, 0::2], loaded[:, 1::2]  # [E, 2 * inter], interleaved (gpt-oss)
        param.data[:, :self.inter].copy_(self._rows(gate, 1))
        param.data[:, self.inter:].copy_(self._rows(up, 1))

    def _load_w2_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        if self.parallel.tp_rank == 0:  # added once, after the all-reduce sums the ranks
            param.data.copy_(loaded)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP over its rows x [n, hidden] -> [n, hidden] (this rank's partial)."""
        if self.kernels is not None:
            gate_up, down = self.kernels[e]
            return down(self.activation(*gate_up(x).chunk(2, dim=-1)))
        b13, b2 = (None, None) if self.w13_bias is None or self.w2_bias is None else (
            self.w13_bias[e], self.w2_bias[e])
        h = self.activation(*F.linear(x, self.w13[e], b13).chunk(2, dim=-1))
        return F.linear(h, self.w2[e], b2)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], weights / ids [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x[t])."""
        if x.shape[0] == 1:  # one token (a single stream's decode): no sort needed
            out = None
            for w, e in zip(weights[0], ids[0].tolist()):
                y = self.expert(e, x) * w
                out = y if out is None else out + y
            assert out is not None
            return out
        flat = ids.flatten()  # [T * k]: pair p is token p // k
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        order = flat.argsort(stable=True)
        tokens = order // ids.shape[1]
        rows = x.index_select(0, tokens)  # [T * k, hidden], grouped by expert
        out_rows = torch.empty_like(rows)
        start = 0
        for e, n in enumerate(counts):
            if n:
                out_rows[start:start + n] = self.expert(e, rows[start:start + n])
                start += n
        out_rows.mul_(weights.flatten().index_select(0, order)[:, None])
        return torch.zeros_like(x).index_add_(0, tokens, out_rows)


class Router(nn.Module):
    """The replicated router (checkpoint name `gate`; gpt-oss's `router`, biased): [T, hidden]
    -> logits [T, experts]. Kept in the model's dtype and never quantised: a flipped choice
    changes the whole expert."""

    def __init__(self, hidden_size: int, num_experts: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(num_experts), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class FusedMoE(nn.Module):
    """Router + stacked experts (+ an optional shared expert with its sigmoid gate, Qwen2-MoE).
    Names mirror transformers': `gate` (router), `experts`, `shared_expert`,
    `shared_expert_gate`. gpt-oss (`bias`, `activation`, `topk_first`): biased router and
    experts, its activation, top-k before the softmax."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, parallel: ParallelContext,
                 shared_expert: nn.Module | None = None, *, bias: bool = False,
                 activation: Activation = silu_and_mul, topk_first: bool = False) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = top_k
        self.renormalize = renormalize
        self.topk_first = topk_first
        self.gate = Router(hidden_size, num_experts, bias)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, parallel,
                                      bias, activation)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None

    def fused(self, x: torch.Tensor) -> torch.Tensor | None:
        """The whole layer (router, top-k, experts, combine) as one C++ call for a step of up to
        cpu_ops.MOE_MAX_ROWS tokens over the packed fp32 stacks, else None (this rank's partial)."""
        experts = self.experts
        if experts.packed is None or x.dtype != torch.float32:
            return None
        from shoal.kernels import cpu_ops

        if x.shape[0] > cpu_ops.MOE_MAX_ROWS:
            return None
        act = experts.activation
        if act is silu_and_mul:
            swiglu = None
        elif isinstance(act, ClampedSwiGLU):
            swiglu = (act.alpha, act.limit)
        else:
            return None
        w13, w2 = experts.packed
        # gpt-oss's top-k-first is the renormalised softmax over the top-k logits
        return cpu_ops.moe_forward(x, self.gate.weight, self.gate.bias, w13, experts.w13_bias,
                                   w2, experts.w2_bias, self.top_k,
                                   self.renormalize or self.topk_first, swiglu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        partial = self.fused(x)
        if partial is None:
            logits = self.gate(x)
            weights, ids = (route_topk_first(logits, self.top_k) if self.topk_first
                            else route(logits, self.top_k, self.renormalize))
            partial = self.experts(x, weights, ids)
        out = self.parallel.all_reduce(partial)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
