"""Flatten one SchedulerOutput into the model's varlen inputs (decodes and prefill chunks together).

Builds input_ids, positions, the KV addressing (slot_mapping, block_tables, seq_lens,
query_start_loc) and the rows where logits are needed: each sampled position, plus every
position of a chunk that wants prompt logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shoal.kernels import Workspace
from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.core.outputs import SchedulerOutput


@dataclass(slots=True)
class ModelInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # [num_logits] int64, rows of the hidden states to project
    sample_rows: list[int | None]  # per scheduled seq: its row in the logits, None = no sample
    chunk_rows: list[int | None]  # per scheduled seq: first logits row of its prompt-logprob chunk


def build_model_inputs(out: SchedulerOutput, block_size: int, device: torch.device,
                       workspace: Workspace | None = None,
                       num_verify: list[int] | None = None) -> ModelInputs:
    """num_verify: per scheduled seq, how many draft tokens end its token_ids (speculative
    decoding): a sampling seq then gets logits rows for its last num_verify + 1 positions, and
    its sample_rows entry is the first of them."""
    seqs = out.scheduled
    num_seqs = len(seqs)
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start_loc = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    sample_rows: list[int | None] = []
    chunk_rows: list[int | None] = []
    max_blocks = max(len(s.block_ids) for s in seqs)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int32)
    for i, s in enumerate(seqs):
        n, start, first = len(s.token_ids), s.start_pos, query_start_loc[-1]
        input_ids.extend(s.token_ids)
        block_tables[i, : len(s.block_ids)] = s.block_ids
        if n == 1:  # a decode: plain ints are cheaper than numpy for one token
            positions.append(start)
            slots.append(s.block_ids[start // block_size] * block_size + start % block_size)
        else:
            pos = np.arange(start, start + n)
            positions.extend(pos.tolist())
            slots.extend((block_tables[i, pos // block_size].astype(np.int64) * block_size
                          + pos % block_size).tolist())
        query_start_loc.append(first + n)
        seq_lens.append(start + n)
        if s.want_prompt_logprobs:
            chunk_rows.append(len(logits_indices))
            logits_indices.extend(range(first, first + n))
            sample_rows.append(len(logits_indices) - 1 if s.is_sampling else None)
        else:
            chunk_rows.append(None)
            if s.is_sampling:
                v = num_verify[i] if num_verify else 0
                sample_rows.append(len(logits_indices))
                logits_indices.extend(range(first + n - 1 - v, first + n))
            else:
                sample_rows.append(None)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.from_numpy(block_tables).to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
        workspace=workspace,
    )
    return ModelInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        meta=meta,
        logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=device),
        sample_rows=sample_rows,
        chunk_rows=chunk_rows,
    )
