"""DecodeGraphs: CUDA graphs for decode-only steps (nano-vllm's capture_cudagraph).

Static input buffers; one graph per listed batch size, captured largest first into one shared
memory pool; a step of n decodes replays the smallest size >= n with the spare lanes padded
(slot -1: nothing written; seq_len 0: nothing read). Prefill and larger batches run eagerly.
"""

from __future__ import annotations

import bisect

import torch
from torch import nn

from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.runner.input_batch import ModelInputs

MAX_GRAPH_BATCH = 512


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """[1, 2, 4, 8] + range(16, max_bs + 1, 16), plus max_bs itself so every decode step fits."""
    max_bs = min(max_num_seqs, MAX_GRAPH_BATCH)
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 16))
    return sizes if sizes[-1] == max_bs else sizes + [max_bs]


class DecodeGraphs:
    """`use_graphs=False` runs the same static buffers eagerly (checks the padding on CPU)."""

    def __init__(self, model: nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, use_graphs: bool = True) -> None:
        self.model = model
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.use_graphs = use_graphs
        max_bs = self.sizes[-1]
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [max_bs]
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=device)  # [max_bs]
        self.slot_mapping = torch.full((max_bs,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(max_bs, max_blocks_per_seq, dtype=torch.int32,
                                        device=device)  # [max_bs, max_blocks_per_seq]
        self.seq_lens = torch.zeros(max_bs, dtype=torch.int32, device=device)  # [max_bs]
        self.query_start_loc = torch.arange(max_bs + 1, dtype=torch.int32, device=device)
        self.outputs: torch.Tensor | None = None  # [max_bs, hidden], written by every replay
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(slot_mapping=self.slot_mapping[:bs],
                                 block_tables=self.block_tables[:bs], seq_lens=self.seq_lens[:bs],
                                 query_start_loc=self.query_start_loc[:bs + 1])

    def _forward(self, bs: int) -> torch.Tensor:  # [bs, hidden]
        return self.model(self.input_ids[:bs], self.positions[:bs], self._meta(bs))

    @torch.inference_mode()
    def capture(self) -> None:
        """Largest size first, so the smaller graphs reuse the first one's pool."""
        pool = None
        for bs in reversed(self.sizes):
            out = self._forward(bs)  # warm-up: compiles the kernels for this shape
            if self.outputs is None:
                self.outputs = torch.empty((self.sizes[-1], out.shape[1]), dtype=out.dtype,
                                           device=out.device)
            if not self.use_graphs:
                continue
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool):
                self.outputs[:bs] = self._forward(bs)
            pool = graph.pool() if pool is None else pool
            self.graphs[bs] = graph
        if self.use_graphs:
            torch.cuda.synchronize()

    def can_run(self, inputs: ModelInputs) -> bool:
        """A decode-only step (one token per sequence) that fits the largest size."""
        n = inputs.input_ids.shape[0]
        return (n == inputs.meta.seq_lens.shape[0] and n <= self.sizes[-1]
                and inputs.meta.block_tables.shape[1] <= self.block_tables.shape[1])

    @torch.inference_mode()
    def run(self, inputs: ModelInputs) -> torch.Tensor:  # [n, hidden], valid until the next run
        n = inputs.input_ids.shape[0]
        bs = self.sizes[bisect.bisect_left(self.sizes, n)]
        meta = inputs.meta
        self.input_ids[:n].copy_(inputs.input_ids)
        self.positions[:n].copy_(inputs.positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        self.block_tables[:n, :meta.block_tables.shape[1]].copy_(meta.block_tables)
        if bs > n:  # padded lanes: write nothing, read nothing, stay in the rotary table
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].zero_()
        assert self.outputs is not None, "DecodeGraphs.capture() first"
        if self.use_graphs:
            self.graphs[bs].replay()
        else:
            self.outputs[:bs] = self._forward(bs)
        return self.outputs[:n]
