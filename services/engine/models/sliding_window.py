"""Which decoder layers attend over a sliding window, read from the HF config as transformers
reads it for each architecture (so greedy parity holds past the window).

A window W means a query at position p sees the keys at positions (p - W, p]; None is full
attention. The kernels take it per call (`paged_attention(..., window)`).
"""

from __future__ import annotations

from typing import Any


def full_attention(cfg: Any) -> list[int | None]:
    """Llama: every layer sees the whole context (a stray `sliding_window` key is ignored, as
    transformers' LlamaModel ignores it)."""
    return [None] * cfg.num_hidden_layers


def every_layer(cfg: Any) -> list[int | None]:
    """Mistral: every layer uses `sliding_window` when the config sets one (v0.1: 4096;
    v0.2 and later: null)."""
    window = _window(cfg)
    return [window] * cfg.num_hidden_layers


def by_layer_types(cfg: Any) -> list[int | None]:
    """Qwen2 / Qwen3: only layers whose `layer_types` entry is "sliding_attention" use the window,
    and only with `use_sliding_window`; without `layer_types`, layers >= `max_window_layers`."""
    window = _window(cfg) if getattr(cfg, "use_sliding_window", False) else None
    if window is None:
        return [None] * cfg.num_hidden_layers
    layer_types = getattr(cfg, "layer_types", None) or [
        "sliding_attention" if i >= getattr(cfg, "max_window_layers", 0) else "full_attention"
        for i in range(cfg.num_hidden_layers)]
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def layer_type(cfg: Any, layer: int) -> str:
    """The layer's `layer_types` entry; without them, sliding on the even layers (the default
    of Gemma 2's and gpt-oss's configs)."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return str(types[layer])
    return "sliding_attention" if layer % 2 == 0 else "full_attention"


def alternating(cfg: Any) -> list[int | None]:
    """Gemma 2 / 3 and gpt-oss: the window on the "sliding_attention" layers (transformers:
    kv > q - window), whether or not the config says `use_sliding_window`."""
    window = _window(cfg)
    return [window if window and layer_type(cfg, i) == "sliding_attention" else None
            for i in range(cfg.num_hidden_layers)]


def _window(cfg: Any) -> int | None:
    window = getattr(cfg, "sliding_window", None)
    return int(window) if window else None
