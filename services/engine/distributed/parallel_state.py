"""One rank's place in a tensor x pipeline parallel engine, and the collectives its layers use.

Ranks are numbered as vLLM numbers them: rank = pp_rank * tp + tp_rank, so the tp ranks of one
pipeline stage are contiguous. Every rank creates every tp group (torch.distributed requires all
ranks to call new_group in the same order) and keeps its own. With tp = pp = 1 no process group
exists: `ParallelContext.single()` makes every collective a no-op, so the model code has one path.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from shoal.services.engine.model_limits import (
    MLP_SIZE_KEYS, check_parallel_sizes, mlp_split_size
)


@dataclass
class CommStats:
    """Seconds and calls per collective on this rank (benchmarks/parallel_throughput.py reads
    rank 0's): what tensor and pipeline parallelism cost beside the compute."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)

    @contextmanager
    def timed(self, op: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[op] = self.seconds.get(op, 0.0) + time.perf_counter() - start
            self.calls[op] = self.calls.get(op, 0) + 1

    def reset(self) -> None:
        self.seconds.clear()
        self.calls.clear()


@dataclass(frozen=True)
class ParallelContext:
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    tp_group: Any = field(default=None, compare=False)
    """The torch.distributed group of this rank's pipeline stage (None when tp == 1)."""
    stats: CommStats = field(default_factory=CommStats, compare=False)

    @staticmethod
    def single() -> ParallelContext:
        return ParallelContext()

    @staticmethod
    def create(rank: int, tp_size: int, pp_size: int) -> ParallelContext:
        """After init_process_group: make every stage's tp group, keep ours."""
        mine = None
        if tp_size > 1:
            for stage in range(pp_size):
                group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
                if stage == rank // tp_size:
                    mine = group
        return ParallelContext(tp_size, pp_size, rank, mine)

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def output_rank(self) -> int:
        """The rank whose RunnerOutput the driver uses: tp rank 0 of the last stage."""
        return (self.pp_size - 1) * self.tp_size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the tp group, in place (row-parallel outputs, the vocab-parallel embedding)."""
        if self.tp_size > 1:
            with self.stats.timed("all_reduce"):
                dist.all_reduce(x, group=self.tp_group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate the tp ranks' shards along the last dim (vocab-parallel logits)."""
        if self.tp_size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        with self.stats.timed("all_gather"):
            dist.all_gather(parts, x.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=-1)

    def min_over_world(self, value: int) -> int:
        """The smallest value any rank has (the KV pool: every rank must hold the same blocks)."""
        if self.world_size == 1:
            return value
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"  # NCCL reduces GPU tensors
        t = torch.tensor([value], dtype=torch.int64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    def send_next(self, tensors: list[torch.Tensor]) -> None:
        """Hand this stage's activations to the same tp rank of the next stage."""
        dst = self.rank + self.tp_size
        with self.stats.timed("send"):
            for t in tensors:
                dist.send(t.contiguous(), dst)

    def recv_prev(self, shapes: list[tuple[int, ...]], dtype: torch.dtype,
                  device: torch.device) -> list[torch.Tensor]:
        src = self.rank - self.tp_size
        out = []
        with self.stats.timed("recv"):
            for shape in shapes:
                t = torch.empty(shape, dtype=dtype, device=device)
                dist.recv(t, src)
                out.append(t)
        return out


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """The contiguous [start, end) of decoder layers a pipeline stage runs; the first stages take
    the remainder one layer each (vLLM's even split)."""
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return start, start + base + (1 if pp_rank < extra else 0)


def kv_heads_per_rank(num_kv_heads: int, tp_size: int) -> int:
    """Each rank's KV heads: a share, or one replicated head when tp exceeds them (vLLM's rule)."""
    return max(1, num_kv_heads // tp_size)


def check_parallel_shapes(hf_config: Any, tp_size: int, pp_size: int) -> None:
    """ConfigError naming what tp (or pp) fails to divide; called before any rank starts (the
    rule is model_limits.py's, which the scheduler applies too)."""
    heads = hf_config.num_attention_heads
    check_parallel_sizes("/".join(getattr(hf_config, "architectures", None) or ["the model"]),
                         heads, getattr(hf_config, "num_key_value_heads", None) or heads,
                         mlp_split_size(getattr(hf_config, k, None) for k in MLP_SIZE_KEYS),
                         hf_config.num_hidden_layers, tp_size, pp_size)
