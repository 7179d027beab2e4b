"""Batched LoRA: the delta of every adapter in a step, added to a linear layer's output.

One step mixes sequences of several adapters and of the base model. Per layer, each adapter
present in the step multiplies only its own tokens' rows: `y[rows] += (x[rows] @ A^T) @ B^T`
(gather with index_select, scatter with index_add_), a loop over the step's adapters (at most
max_loras), never over requests or tokens; rows of the base model are untouched, and a step
whose tokens all use one adapter skips the gather. The scaling (alpha / r) is folded into B.

Packed layers (q/k/v, gate/up) get one A with the shards' ranks stacked and one block-diagonal
B, so a packed layer's delta is two matmuls as an unpacked one's. Under tensor parallelism the
weights are cut like their layer's (runner/lora_manager.py): column-parallel layers keep their
rows of B, row-parallel ones their columns of A, so the delta joins the partial products before
the layer's all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class LoRAWeights:
    """One adapter's weights for one layer, on the device: A [R, in], B [out, R] (scaled)."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(slots=True)
class LoRABatch:
    """The step's adapters: per adapter its layers' weights and the rows of its tokens (None:
    every row of the step). Set by the runner before the forward, read by every layer."""

    groups: list[tuple[dict[str, LoRAWeights], torch.Tensor | None]] = field(default_factory=list)


class LoRALayer:
    """The hook a targeted Linear calls (Linear.lora): adds each adapter's delta to y."""

    __slots__ = ("batch", "name")

    def __init__(self, batch: LoRABatch, name: str) -> None:
        self.batch = batch
        self.name = name

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        for weights, rows in self.batch.groups:
            w = weights.get(self.name)
            if w is None:
                continue
            if rows is None:
                y.add_((x @ w.a.t()) @ w.b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ w.a.t()) @ w.b.t())
