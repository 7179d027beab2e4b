"""The bandwidth bound of a single stream: every decode step reads every weight once, so
tokens/s <= read bandwidth / weight bytes per token. The bandwidth is measured in the same run
(a large array summed, one and two threads), beside the engines it bounds.

Weight bytes per token: every tensor a step reads in full (the matmuls, the LM head); an input
embedding is one row a token (nothing) unless it is the LM head too (tied).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

BYTES_PER_WEIGHT = {"float32": 4.0, "bfloat16": 2.0, "float16": 2.0, "int8": 1.0, "int4": 0.5}
"""Nominal bytes a single stream reads per weight, by what it runs (scales left out)."""
EMBEDDINGS = ("model.embed_tokens.weight", "token_embd.weight")


def weight_bytes_per_token(tensor_bytes: Mapping[str, int | float], tied: bool) -> float:
    """Bytes one decode step reads: every tensor but the input embedding, which counts only
    when it is the LM head as well (`tied`)."""
    return float(sum(n for name, n in tensor_bytes.items() if tied or name not in EMBEDDINGS))


def bound_tokens_per_s(weight_bytes: float, bandwidth: float) -> float:
    """The most tokens/s a single stream can decode when reading the weights takes all the time."""
    if weight_bytes <= 0 or bandwidth <= 0:
        raise ValueError("weight bytes and bandwidth must be positive")
    return bandwidth / weight_bytes


def fraction_of_bound(tokens_per_s: float, weight_bytes: float, bandwidth: float) -> float:
    """Measured tokens/s as a fraction of the bandwidth bound (1.0 = reading at full speed)."""
    return tokens_per_s / bound_tokens_per_s(weight_bytes, bandwidth)


def ratio(value: float, reference: float) -> float:
    """value / reference, nan without a reference (a peer that did not run)."""
    return value / reference if reference else float("nan")


def hf_tensor_bytes(folder: Path, bytes_per_weight: float) -> dict[str, float]:
    """Each weight tensor of a Hugging Face folder at `bytes_per_weight` (what the engine keeps,
    not what the file stores); 1-D tensors (norms) at their stored size (negligible)."""
    from safetensors import safe_open

    out: dict[str, float] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), framework="np") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                out[name] = float(np.prod(shape)) * (bytes_per_weight if len(shape) == 2 else 4)
    return out


def gguf_tensor_bytes(path: Path) -> dict[str, float]:
    """Each tensor of a .gguf file as stored (its quantised blocks)."""
    from gguf import GGUFReader

    return {t.name: float(t.n_bytes) for t in GGUFReader(str(path)).tensors}


def read_bandwidth(threads: int = 1, gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s summing a `gib` GiB float32 array, split among `threads` threads (numpy lets the
    GIL go while it reduces), best of `repeats`: the rate a decode step's weights stream at."""
    data = np.ones(int(gib * 2**30) // 4, dtype=np.float32)
    parts = np.array_split(data, threads)
    best = 0.0
    for _ in range(repeats):
        workers = [threading.Thread(target=np.sum, args=(part,)) for part in parts]
        start = time.perf_counter()
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        best = max(best, data.nbytes / (time.perf_counter() - start))
    return best


def measure_bandwidth(gib: float = 1.0) -> dict[str, float]:
    """Read bandwidth on one and on two threads, bytes/s; `best` is the larger."""
    one, two = read_bandwidth(1, gib), read_bandwidth(2, gib)
    return {"one_thread": one, "two_threads": two, "best": max(one, two)}
