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
class PaddedGroups:
    """Several adapters' rows laid out as a [groups, length] grid (short groups padded with
    their first row), so each layer runs two bmm over all of them instead of a matmul pair per
    adapter: `index` [groups * length] rows of x, `valid` the grid positions that are real,
    `rows` their rows of y. `stacks`: per layer, every group's A^T [groups, in, R] and B^T
    [groups, R, out] (ranks zero-padded to the largest), built at the layer's first use and
    kept while the step's adapters stay the same (decode steps)."""

    index: torch.Tensor
    valid: torch.Tensor
    rows: torch.Tensor
    num_groups: int
    length: int
    weights: list[dict[str, LoRAWeights]]
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor] | None]


@dataclass(slots=True)
class LoRABatch:
    """The step's adapters: per adapter its layers' weights and the rows of its tokens (None:
    every row of the step), or all of them padded into one grid. Set by the runner before the
    forward, read by every layer."""

    groups: list[tuple[dict[str, LoRAWeights], torch.Tensor | None]] = field(default_factory=list)
    padded: PaddedGroups | None = None


class LoRALayer:
    """The hook a targeted Linear calls (Linear.lora): adds each adapter's delta to y."""

    __slots__ = ("batch", "name")

    def __init__(self, batch: LoRABatch, name: str) -> None:
        self.batch = batch
        self.name = name

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        padded = self.batch.padded
        if padded is not None:
            if self.name not in padded.stacks:
                padded.stacks[self.name] = _stack(padded.weights, self.name)
            stack = padded.stacks[self.name]
            if stack is None:
                return
            a_t, b_t = stack
            grid = x.index_select(0, padded.index).view(padded.num_groups, padded.length, -1)
            delta = torch.bmm(torch.bmm(grid, a_t), b_t).view(-1, y.shape[1])
            y.index_add_(0, padded.rows, delta.index_select(0, padded.valid))
            return
        for weights, rows in self.batch.groups:
            w = weights.get(self.name)
            if w is None:
                continue
            if rows is None:
                y.add_((x @ w.a.t()) @ w.b.t())
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ w.a.t()) @ w.b.t())


def _stack(weights: list[dict[str, LoRAWeights]], name: str
           ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every group's A^T and B^T for one layer, ranks zero-padded (an adapter without this
    layer contributes zeros); None when no adapter of the step has the layer."""
    found = [w.get(name) for w in weights]
    present = [w for w in found if w is not None]
    if not present:
        return None
    rank = max(w.a.shape[0] for w in present)
    first = present[0]
    a_t = first.a.new_zeros(len(found), first.a.shape[1], rank)
    b_t = first.b.new_zeros(len(found), rank, first.b.shape[0])
    for g, w in enumerate(found):
        if w is not None:
            a_t[g, :, :w.a.shape[0]] = w.a.t()
            b_t[g, :w.a.shape[0], :] = w.b.t()
    return a_t, b_t
