"""The benchmarks' bandwidth-bound arithmetic (benchmarks/bound.py): what a single stream reads
per token, the bound it gives, and the fractions and ratios the figures are reported as."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from benchmarks.bound import (bound_tokens_per_s, fraction_of_bound, hf_tensor_bytes, ratio,
                              read_bandwidth, weight_bytes_per_token)


def test_weight_bytes_count_the_embedding_only_when_tied() -> None:
    tensors = {"model.embed_tokens.weight": 100.0, "model.layers.0.mlp.up_proj.weight": 40.0,
               "lm_head.weight": 100.0}
    assert weight_bytes_per_token(tensors, tied=False) == 140.0  # one embedding row: nothing
    gguf = {"token_embd.weight": 100.0, "blk.0.ffn_up.weight": 40.0}
    assert weight_bytes_per_token(gguf, tied=True) == 140.0  # the head is the embedding


def test_bound_and_fraction() -> None:
    assert bound_tokens_per_s(2e9, 20e9) == 10.0  # 2 GB a token at 20 GB/s
    assert fraction_of_bound(8.0, 2e9, 20e9) == pytest.approx(0.8)
    with pytest.raises(ValueError):
        bound_tokens_per_s(0, 20e9)
    assert ratio(15.0, 10.0) == 1.5 and math.isnan(ratio(1.0, 0.0))


def test_hf_tensor_bytes_at_the_engine_s_width(tmp_path: Path) -> None:
    save_file({"a.weight": torch.zeros(4, 8, dtype=torch.bfloat16), "n.weight": torch.zeros(8)},
              str(tmp_path / "model.safetensors"))
    assert hf_tensor_bytes(tmp_path, 1.0) == {"a.weight": 32.0, "n.weight": 32.0}


def test_read_bandwidth_is_a_rate() -> None:
    assert read_bandwidth(threads=2, gib=1 / 64, repeats=1) > 0
