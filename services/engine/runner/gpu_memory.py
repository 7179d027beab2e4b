"""Size the KV pool on CUDA by profiling: run a full-size batch (max_num_batched_tokens tokens over
up to max_num_seqs sequences, plus their logits) and give the pool what gpu_memory_utilization
leaves after the weights, that peak, memory outside torch's allocator and a CUDA-graph reserve.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from shoal.services.engine.layers.attention import AttentionMetadata
from shoal.services.engine.config import ConfigError, EngineConfig
from shoal.services.engine.runner.kv_cache import attention_layers

GRAPH_RESERVE_BYTES = 256 << 20
"""Kept back for the CUDA graphs' pool and the allocator's fragmentation."""


def dummy_batch(num_tokens: int, num_seqs: int, max_model_len: int, block_size: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input_ids, positions, meta) of prompts totalling num_tokens; writes nothing (slot -1)."""
    num_seqs = max(1, min(num_seqs, num_tokens))
    lens = [min(max_model_len, num_tokens // num_seqs + (i < num_tokens % num_seqs))
            for i in range(num_seqs)]
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)  # [num_tokens]
    max_blocks = -(-max(lens) // block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.full((positions.shape[0],), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(num_seqs, max_blocks, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(),
                                     dtype=torch.int32, device=device))
    return torch.zeros_like(positions), positions, meta


@torch.inference_mode()
def profile_kv_cache_memory(model: nn.Module, config: EngineConfig, max_model_len: int,
                            dtype: torch.dtype, device: torch.device) -> int:
    """Bytes the KV pool may take on `device` (may be <= 0: the caller refuses it)."""
    layers = attention_layers(model)
    saved = [(layer.k_cache, layer.v_cache) for layer in layers]
    # one zeroed block, shared: the dummy batch reads block 0 and writes nothing
    scratch = torch.zeros((1, config.block_size, layers[0].num_kv_heads, layers[0].head_dim),
                          dtype=dtype, device=device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        for layer in layers:
            layer.k_cache = layer.v_cache = scratch
        input_ids, positions, meta = dummy_batch(config.max_num_batched_tokens, config.max_num_seqs,
                                                 max_model_len, config.block_size, device)
        hidden = model(input_ids, positions, meta)  # [num_tokens, hidden]
        last = meta.query_start_loc[1:].long() - 1  # [num_seqs]
        logits = model.compute_logits(hidden, last)  # [num_seqs, vocab] float32
        torch.softmax(logits, dim=-1)  # the sampler's working set
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
        del hidden, logits, input_ids, positions, meta
    finally:
        for layer, (k, v) in zip(layers, saved):
            layer.k_cache, layer.v_cache = k, v
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    return int(total * config.gpu_memory_utilization) - peak - non_torch - GRAPH_RESERVE_BYTES


def profiled_config(config: EngineConfig, model: nn.Module, max_model_len: int, dtype: torch.dtype,
                    device: torch.device) -> EngineConfig:
    """`config` with kv_cache_memory profiled, unless the user fixed the pool size."""
    if config.kv_cache_memory is not None or config.num_kv_blocks is not None:
        return config
    budget = profile_kv_cache_memory(model, config, max_model_len, dtype, device)
    if budget <= 0:
        raise ConfigError(f"gpu_memory_utilization {config.gpu_memory_utilization} leaves no room "
                          f"for the KV cache after the weights and a full-size batch ({budget} B)")
    return dataclasses.replace(config, kv_cache_memory=budget)
