"""MoE layers alone, two paths, same process, rounds interleaved (issue 28): `moe_forward` (the
whole layer in one C++ call over the packed stacks, cpu_ops.moe_forward) and `per_expert` (torch
routing, the step sorted by expert and each active expert's own oneDNN kernels, the path of steps
over MOE_MAX_ROWS tokens). The layer is
benchmarks/moe_decode's: 8 experts of 768, top-2, hidden 576, fp32, with the CPU kernels
`prepare_cpu_weights` gives it. One layer's 42 MB of experts mostly fit a 32 MB L3, so
`--layers 1` measures compute and op overhead; `--layers 12` chains 12 layers (500 MB) so the
weights stream from memory as in a model's decode.

    .venv/bin/python -m benchmarks.moe_layer [--layers 1] [--threads 1] [--rows 1,2,8,16,32,64]
        [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import torch

MODES = ("per_expert", "moe_forward")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,2,8,16,32,64")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from shoal.kernels import cpu_ops
    from shoal.services.engine.distributed.parallel_state import ParallelContext
    from shoal.services.engine.layers.cpu_weights import prepare_cpu_weights
    from shoal.services.engine.layers.moe import FusedMoE

    torch.manual_seed(0)
    layers = [FusedMoE(8, 2, 576, 768, True, ParallelContext.single())
              for _ in range(args.layers)]
    for layer in layers:
        for p in layer.parameters():
            p.data.normal_(0, 0.05)
    prepare_cpu_weights(torch.nn.Sequential(*layers), None)
    stacks = [layer.experts.packed for layer in layers]
    limit = cpu_ops.MOE_MAX_ROWS

    def once(rows: int, mode: str, n: int) -> float:
        """Microseconds per layer call, `n` steps through every layer."""
        cpu_ops.MOE_MAX_ROWS = 1 << 30 if mode == "moe_forward" else 0
        for layer, stack in zip(layers, stacks):
            layer.experts.packed = None if mode == "per_expert" else stack
        xs = [torch.randn(rows, 576) for _ in range(n + 2)]
        start = 0.0
        for i, x in enumerate(xs):
            if i == 2:
                start = time.perf_counter()
            for layer in layers:
                x = x + 0.1 * layer(x)
        return (time.perf_counter() - start) / n / len(layers) * 1e6

    print(f"{args.layers} MoE layer(s), {args.threads} thread(s), us per layer call (best / "
          f"median of {args.rounds} interleaved rounds); MOE_MAX_ROWS = {limit}")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            n = max(4, 200 // rows // args.layers)
            runs: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(once(rows, mode, n))
            mid = args.rounds // 2
            cells = "  ".join(f"{m} {sorted(v)[0]:8.1f} / {sorted(v)[mid]:8.1f}"
                              for m, v in runs.items())
            ratio = min(runs["moe_forward"]) / min(runs["per_expert"])
            print(f"rows {rows:4d}: {cells}  moe_forward / per_expert (best) {ratio:.2f}")
    cpu_ops.MOE_MAX_ROWS = limit
    for layer, stack in zip(layers, stacks):
        layer.experts.packed = stack


if __name__ == "__main__":
    main()
