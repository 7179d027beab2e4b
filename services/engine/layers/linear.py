"""Linear layers, plain and packed (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

Packing turns three (or two) small matmuls into one; each parameter carries a `weight_loader`
that knows where a checkpoint shard goes, so loader.py stays a short loop (nano-vllm's shape).

Tensor parallel (Megatron's split, as vLLM's): the packed q/k/v and gate/up layers are
column-parallel (each rank holds its heads / its slice of the MLP, no communication), o_proj and
down_proj are `RowParallelLinear` (each rank multiplies its input slice, one all-reduce sums).
The loaders cut each rank's slice out of the checkpoint tensor, so no rank keeps the whole weight.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from shoal.services.engine.distributed.parallel_state import ParallelContext, kv_heads_per_rank


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} != {tuple(param.shape)}"
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # this rank's
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The weight prepared for a faster CPU kernel after loading (cpu_weights.py)."""
        self.lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None
        """LoRA adapters' delta, added in place to the output (layers/lora.py; enable_lora)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        y = self.kernel(x) if self.kernel is not None else F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            self.lora(x, y)
        return y


class RowParallelLinear(Linear):
    """Input dim split across the tp ranks; the partial products are summed by one all-reduce.
    The bias is added once: rank 0 holds it, the others a zero bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        self.parallel = parallel or ParallelContext.single()
        self.in_total = in_features
        super().__init__(in_features // self.parallel.tp_size, out_features, bias)
        self.weight.weight_loader = self._load_weight  # type: ignore[attr-defined]
        if self.bias is not None:
            self.bias.weight_loader = self._load_bias  # type: ignore[attr-defined]

    def _load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert loaded.shape == (param.shape[0], self.in_total), (tuple(loaded.shape),
                                                                 tuple(param.shape))
        width = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.parallel.tp_rank * width, width))

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        assert loaded.shape == param.shape, (tuple(loaded.shape), tuple(param.shape))
        param.data.copy_(loaded if self.parallel.tp_rank == 0 else torch.zeros_like(loaded))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [n, in / tp] -> [n, out]
        return self.parallel.all_reduce(super().forward(x))


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim, loaded by shard id.
    Column-parallel: `shard_sizes` are this rank's; `source_rows[shard] = (start, total)` says
    where its rows start in the checkpoint tensor of `total` rows."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False,
                 source_rows: dict[str, tuple[int, int]] | None = None) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        self.source_rows = source_rows or {k: (0, size) for k, size in shard_sizes.items()}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: str | None = None) -> None:
        """One shard's checkpoint tensor; shard_id None: a fused one (Phi-3's qkv_proj and
        gate_up_proj), every shard's full rows stacked in our order, each cut as its own."""
        if shard_id is None:
            start = 0
            for shard in self.shard_offsets:
                total = self.source_rows[shard][1]
                self._load_shard(param, loaded.narrow(0, start, total), shard)
                start += total
            assert start == loaded.shape[0], (tuple(loaded.shape), start)
            return
        offset, size = self.shard_offsets[shard_id]
        start, total = self.source_rows[shard_id]
        target = param.data.narrow(0, offset, size)
        assert loaded.shape[0] == total and target.shape[1:] == loaded.shape[1:], (
            shard_id, tuple(loaded.shape), tuple(target.shape), total)
        target.copy_(loaded.narrow(0, start, size))


class QKVLinear(PackedLinear):
    """Column-parallel q/k/v: each rank its query heads and its KV heads (one replicated KV head
    per rank when tp exceeds the KV heads: rank r holds head r // (tp / num_kv_heads))."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, parallel: ParallelContext | None = None) -> None:
        p = parallel or ParallelContext.single()
        q_heads, kv_heads = num_heads // p.tp_size, kv_heads_per_rank(num_kv_heads, p.tp_size)
        first_kv = (p.tp_rank * kv_heads if p.tp_size <= num_kv_heads
                    else p.tp_rank // (p.tp_size // num_kv_heads))
        kv_rows = (first_kv * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden_size, {"q": q_heads * head_dim, "k": kv_heads * head_dim,
                                       "v": kv_heads * head_dim}, bias,
                         {"q": (p.tp_rank * q_heads * head_dim, num_heads * head_dim),
                          "k": kv_rows, "v": kv_rows})


class GateUpLinear(PackedLinear):
    """Column-parallel gate/up: each rank its slice of the intermediate size."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 parallel: ParallelContext | None = None) -> None:
        p = parallel or ParallelContext.single()
        size = intermediate_size // p.tp_size
        rows = (p.tp_rank * size, intermediate_size)
        super().__init__(hidden_size, {"gate": size, "up": size}, bias, {"gate": rows, "up": rows})
