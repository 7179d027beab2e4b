"""Where a single stream's GGUF decode step goes: the step (end to end, greedy, 2 threads)
against the same step's block matmuls alone (every GGUFBlockLinear of the loaded engine called
once on one row, in model order), with the read bandwidth measured in the same round
(benchmarks/bound.py): the matmuls' GB/s as a fraction of it, and the rest of the step
(attention, norms, rotary, sampling, Python) in ms.

    .venv/bin/python -m benchmarks.gguf_step [--file Q4_K_M] [--rounds 3] [--tokens 128]
The file is issue 31's 1B model's (benchmarks/model_1b.py; `--file` a path for another GGUF).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from benchmarks.bound import read_bandwidth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--file", default="Q4_K_M")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from benchmarks.model_1b import CACHE
    from shoal.services.engine import LLM, SamplingParams
    from shoal.services.engine.layers.gguf_weights import TYPE_NAMES, GGUFBlockLinear

    path = Path(args.file) if args.file.endswith(".gguf") else \
        CACHE / f"llama-1b-random-s0-{args.file}.gguf"
    llm = LLM(str(path), device="cpu", dtype="float32", num_threads=args.threads,
              quantization="gguf", kv_cache_memory=256 * 2**20, max_model_len=1024)
    layers = [(f"{name}.{attr}", v) for name, module in llm.engine.runner.model.named_modules()
              for attr, v in vars(module).items() if isinstance(v, GGUFBlockLinear)]
    for name, layer in layers:
        if any(t != layers[0][1].parts[0][0] for t, _ in layer.parts):
            print(f"{name}: rows {layer.rows} as {[TYPE_NAMES[t] for t, _ in layer.parts]}")
    weight_bytes = sum(b.numel() for _, layer in layers for _, b in layer.parts)
    xs = {layer.in_features: torch.randn(1, layer.in_features) for _, layer in layers}
    prompt = list(range(100, 140))
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    steps = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    torch.set_num_threads(args.threads)
    for _ in range(args.rounds):
        bandwidth = read_bandwidth(args.threads)
        start = time.perf_counter()
        llm.generate([prompt], first, use_tqdm=False)
        prefill = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([prompt], steps, use_tqdm=False)
        step = (time.perf_counter() - start - prefill) / (args.tokens - 1)
        alone = float("inf")
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(10):
                for _, layer in layers:
                    layer(xs[layer.in_features])
            alone = min(alone, (time.perf_counter() - start) / 10)
        print(f"read {bandwidth / 1e9:.1f} GB/s, weights {weight_bytes / 1e6:.0f} MB (bound "
              f"{bandwidth / weight_bytes:.1f} tok/s): step {step * 1e3:.2f} ms ({1 / step:.1f} "
              f"tok/s, {weight_bytes / step / bandwidth:.0%} of the bound); matmuls alone "
              f"{alone * 1e3:.2f} ms ({weight_bytes / alone / 1e9:.1f} GB/s, "
              f"{weight_bytes / alone / bandwidth:.0%} of read); "
              f"rest {(step - alone) * 1e3:.2f} ms", flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
