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
float32, top-k, then renormalised to sum to 1 when `norm_topk_prob` (Mixtral always).

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
from shoal.services.engine.layers.linear import default_weight_loader

Kernel = Callable[[torch.Tensor], torch.Tensor]

_PER_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")


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


def route(logits: torch.Tensor, top_k: int, renormalize: bool
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] in the logits' dtype, expert ids [T, k])."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids


class StackedExperts(nn.Module):
    """Every expert's gated MLP, this rank's slice of each (see the module docstring)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 parallel: ParallelContext) -> None:
        super().__init__()
        self.parallel = parallel
        self.num_experts = num_experts
        self.inter_total = intermediate_size
        self.inter = intermediate_size // parallel.tp_size  # this rank's slice
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * self.inter, hidden_size),
                                requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, self.inter),
                               requires_grad=False)
        self.w13.weight_loader = self._load_w13  # type: ignore[attr-defined]
        self.w2.weight_loader = self._load_w2  # type: ignore[attr-defined]
        self.kernels: list[tuple[Kernel, Kernel]] | None = None
        """Per expert, its (gate/up, down) CPU kernels, set after loading (cpu_weights.py)."""

    def _rows(self, loaded: torch.Tensor, dim: int) -> torch.Tensor:
        """This rank's slice of a tensor whose `dim` is the full intermediate size."""
        assert loaded.shape[dim] == self.inter_total, (tuple(loaded.shape), self.inter_total)
        return loaded.narrow(dim, self.parallel.tp_rank * self.inter, self.inter)

    def _load_w13(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert, part = shard
        if expert is None:  # stacked [E, 2 * inter, hidden]: gate rows, then up rows
            gate, up = loaded.split(self.inter_total, dim=1)
            param.data[:, :self.inter].copy_(self._rows(gate, 1))
            param.data[:, self.inter:].copy_(self._rows(up, 1))
            return
        offset = 0 if part == "gate" else self.inter
        param.data[expert, offset:offset + self.inter].copy_(self._rows(loaded, 0))

    def _load_w2(self, param: nn.Parameter, loaded: torch.Tensor, shard: tuple) -> None:
        expert, _ = shard
        if expert is None:  # stacked [E, hidden, inter]
            param.data.copy_(self._rows(loaded, 2))
        else:
            param.data[expert].copy_(self._rows(loaded, 1))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP over its rows x [n, hidden] -> [n, hidden] (this rank's partial)."""
        if self.kernels is not None:
            gate_up, down = self.kernels[e]
            h = gate_up(x)
        else:
            h = F.linear(x, self.w13[e])
        gate, up = h.chunk(2, dim=-1)
        h = F.silu(gate) * up
        return down(h) if self.kernels is not None else F.linear(h, self.w2[e])

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
    """The replicated router (checkpoint name `gate`): [T, hidden] -> logits [T, experts]. Kept
    in the model's dtype and never quantised: a flipped choice changes the whole expert."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class FusedMoE(nn.Module):
    """Router + stacked experts (+ an optional shared expert with its sigmoid gate, Qwen2-MoE).
    Names mirror transformers': `gate` (router), `experts`, `shared_expert`,
    `shared_expert_gate`."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, parallel: ParallelContext,
                 shared_expert: nn.Module | None = None) -> None:
        super().__init__()
        self.parallel = parallel
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = Router(hidden_size, num_experts)
        self.experts = StackedExperts(num_experts, hidden_size, intermediate_size, parallel)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Router(hidden_size, 1) if shared_expert is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        weights, ids = route(self.gate(x), self.top_k, self.renormalize)
        out = self.parallel.all_reduce(self.experts(x, weights, ids))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
