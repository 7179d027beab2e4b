"""Same-run A/B of the MoE layer's one-token path (batch 1, 1 thread): Shoal on one random-weight
Qwen3-MoE folder twice, one engine with `packed` cleared (each expert's own oneDNN kernels, the
path before cpu_ops.moe_forward), and the dense model of the active size
(benchmarks/moe_decode's models, `layers` deep); rounds interleaved, the order flipped every
round. Ratios below 1: the first engine named is faster.

    .venv/bin/python -m benchmarks.moe_fused_ab LAYERS ROUNDS
"""

from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from benchmarks.moe_decode import build, decode_seconds_per_token


def main() -> None:
    from shoal.services.engine import LLM
    from shoal.services.engine.layers.moe import StackedExperts
    from tests.tiny_models import tokenizer_dir

    layers, rounds = int(sys.argv[1]), int(sys.argv[2])
    root = Path(tempfile.gettempdir()) / f"shoal-moe-ab{layers}"
    for name in ("moe", "dense"):
        if not (root / name / "config.json").exists():
            print(name, build(root / name, name == "moe", layers))
            for f in ("tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tokenizer_dir() / f, root / name / f)

    def make(name: str) -> LLM:
        return LLM(str(root / name), device="cpu", dtype="float32", num_threads=1,
                   kv_cache_memory=128 * 2**20, max_num_seqs=8, enable_prefix_caching=False)

    engines = {"moe_fused": make("moe"), "moe_per_expert": make("moe"), "dense": make("dense")}
    for module in engines["moe_per_expert"].engine.runner.model.modules():
        if isinstance(module, StackedExperts):
            module.packed = None
    for engine in engines.values():
        decode_seconds_per_token(engine, 1, 4, 0)  # warm up
    print("load at start", os.getloadavg())
    times: dict[str, list[float]] = {n: [] for n in engines}
    for r in range(rounds):
        for n in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            times[n].append(decode_seconds_per_token(engines[n], 1, 32, r) * 1e3)
    for n, v in times.items():
        print(f"{n}: median {statistics.median(v):.1f} ms/step, best {min(v):.1f}; "
              f"rounds {[round(x, 1) for x in v]}")
    med = {n: statistics.median(v) for n, v in times.items()}
    best = {n: min(v) for n, v in times.items()}
    for a, b in (("moe_fused", "moe_per_expert"), ("moe_fused", "dense"),
                 ("moe_per_expert", "dense")):
        print(f"{a} / {b}: median {med[a] / med[b]:.3f}x, best {best[a] / best[b]:.3f}x")
    print("load at end", os.getloadavg())


if __name__ == "__main__":
    main()
