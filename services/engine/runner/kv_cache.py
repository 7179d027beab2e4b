"""Size the KV block pool from a memory budget and allocate the per-layer caches
(docs/architecture.md "KV-cache contract").

One tensor per K and V for all layers, `[num_layers, num_blocks, block_size, num_kv_heads,
head_dim]`; each Attention layer gets its contiguous `[num_blocks, ...]` slice.
"""

from __future__ import annotations

import torch
from torch import nn

from shoal.services.engine.layers.attention import Attention
from shoal.services.engine.config import ENGINE_DEFAULTS, ConfigError, EngineConfig


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def block_bytes(model: nn.Module, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    layers = attention_layers(model)
    per_layer = block_size * layers[0].num_kv_heads * layers[0].head_dim * dtype.itemsize
    return 2 * len(layers) * per_layer


def num_kv_blocks(config: EngineConfig, model: nn.Module, dtype: torch.dtype,
                  device: torch.device) -> int:
    if config.num_kv_blocks is not None:
        return config.num_kv_blocks
    budget = config.kv_cache_memory
    if budget is None:
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            used = total - free
            budget = (int(total * config.gpu_memory_utilization) - used
                      - ENGINE_DEFAULTS.gpu_activation_reserve)
        else:
            budget = ENGINE_DEFAULTS.cpu_kv_cache_memory
    blocks = budget // block_bytes(model, config.block_size, dtype)
    if blocks < 1:
        raise ConfigError(f"the KV-cache budget ({budget} bytes) holds no block of "
                          f"{config.block_size} tokens")
    return int(blocks)


def bind_kv_caches(model: nn.Module, num_blocks: int, block_size: int, dtype: torch.dtype,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Allocate zeroed caches (padding lanes read them: they must hold no NaN) and bind them."""
    layers = attention_layers(model)
    shape = (len(layers), num_blocks, block_size, layers[0].num_kv_heads, layers[0].head_dim)
    k_caches = torch.zeros(shape, dtype=dtype, device=device)
    v_caches = torch.zeros(shape, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = k_caches[i], v_caches[i]
    return k_caches, v_caches
