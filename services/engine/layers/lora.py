"""Batched LoRA: the delta of every adapter in a step, added to a linear layer's output.

One step mixes sequences of several adapters and of the base model. A small step (decode) with
several adapters stacks them: `y += ((x @ A_all^T) * mask) @ B_all`, the mask keeping each
row's own adapter's rank columns (DenseGroups: three dense ops a layer whatever the adapters).
Otherwise each adapter multiplies only its own tokens' rows: `y[rows] += (x[rows] @ A^T) @ B^T`
(gather with index_select, scatter with index_add_), a loop over the step's adapters (at most
max_loras), never over requests or tokens; a step whose tokens all use one adapter skips the
gather. Rows of the base model are untouched. The scaling (alpha / r) is folded into B.

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
class DenseGroups:
    """A small step with several adapters (decode): every adapter's A stacked into one matrix,
    so a layer's delta is `((x @ A_all^T) * mask) @ B_all` over all rows at once (the mask keeps
    each row's own adapter's rank columns; base rows get none): three dense ops a layer, no
    gather or scatter. `row_group`: each row's adapter (-1: the base model). `stacks`: per
    layer A_all^T [in, sum R] and B_all [sum R, out] with its ranks, kept while the step's
    adapters stay the same; `masks`: per rank layout, this step's."""

    row_group: torch.Tensor
    weights: list[dict[str, LoRAWeights]]
    stacks: dict[str, tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None]
    masks: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)


@dataclass(slots=True)
class LoRABatch:
    """The step's adapters: per adapter its layers' weights and the rows of its tokens (None:
    every row of the step), or all of them stacked (DenseGroups). Set by the runner before the
    forward, read by every layer."""

    groups: list[tuple[dict[str, LoRAWeights], torch.Tensor | None]] = field(default_factory=list)
    dense: DenseGroups | None = None


class LoRALayer:
    """The hook a targeted Linear calls (Linear.lora): adds each adapter's delta to y."""

    __slots__ = ("batch", "name")

    def __init__(self, batch: LoRABatch, name: str) -> None:
        self.batch = batch
        self.name = name

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        dense = self.batch.dense
        if dense is not None:
            if self.name not in dense.stacks:
                dense.stacks[self.name] = _stack(dense.weights, self.name)
            stack = dense.stacks[self.name]
            if stack is None:
                return
            a_t, b, ranks = stack
            mask = dense.masks.get(ranks)
            if mask is None:
                cols = torch.repeat_interleave(torch.arange(len(ranks), device=x.device),
                                               torch.tensor(ranks, device=x.device))
                mask = dense.masks[ranks] = (dense.row_group[:, None] == cols[None, :]).to(x.dtype)
            y.addmm_((x @ a_t).mul_(mask), b)
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
           ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]] | None:
    """Every adapter's A^T side by side and B stacked for one layer, with each one's rank (0 for
    an adapter without this layer); None when no adapter of the step has the layer."""
    found = [w.get(name) for w in weights]
    present = [w for w in found if w is not None]
    if not present:
        return None
    a_t = torch.cat([w.a for w in present]).t().contiguous()
    b = torch.cat([w.b.t() for w in present]).contiguous()
    return a_t, b, tuple(0 if w is None else w.a.shape[0] for w in found)
