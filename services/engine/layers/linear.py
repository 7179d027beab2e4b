"""Linear layers, plain and packed (q/k/v -> qkv_proj, gate/up -> gate_up_proj).

Packing turns three (or two) small matmuls into one; each parameter carries a `weight_loader`
that knows where a checkpoint shard goes, so loader.py stays a short loop (nano-vllm's shape).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor) -> None:
    assert param.shape == loaded.shape, f"shape {tuple(loaded.shape)} != {tuple(param.shape)}"
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.bias: nn.Parameter | None = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = default_weight_loader  # type: ignore[attr-defined]
        self.kernel: Callable[[torch.Tensor], torch.Tensor] | None = None
        """The weight prepared for a faster CPU kernel after loading (cpu_weights.py)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in] -> [num_tokens, out]
        if self.kernel is not None:
            return self.kernel(x)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim, loaded by shard id."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        offset = 0
        for shard_id, size in shard_sizes.items():
            self.shard_offsets[shard_id] = (offset, size)
            offset += size
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self._load_shard  # type: ignore[attr-defined]

    def _load_shard(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str) -> None:
        offset, size = self.shard_offsets[shard_id]
        target = param.data.narrow(0, offset, size)
        assert target.shape == loaded.shape, (shard_id, tuple(loaded.shape), tuple(target.shape))
        target.copy_(loaded)


class QKVLinear(PackedLinear):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False) -> None:
        super().__init__(hidden_size, {"q": num_heads * head_dim, "k": num_kv_heads * head_dim,
                                       "v": num_kv_heads * head_dim}, bias)


class GateUpLinear(PackedLinear):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__(hidden_size, {"gate": intermediate_size, "up": intermediate_size}, bias)
