"""One MoE layer, the one-call C++ path (`cpu_ops.moe_forward`) against the torch path (the
step's tokens sorted by expert, each active expert's own kernels: the GEMV up to 2 rows, oneDNN
from 3), same process, rounds interleaved (issue 28). The layer is benchmarks/moe_decode's: 8
experts of 768, top-2, hidden 576, fp32 with the CPU kernels `prepare_cpu_weights` gives it.
Its 42 MB of experts mostly fit a 32 MB L3, so the figures are the layer's compute and op
overhead more than the memory stream a whole model's decode sees (benchmarks/moe_decode).

    .venv/bin/python -m benchmarks.moe_layer [--threads 1] [--rows 1,2,8,16,32,64] [--rounds 7]
"""

from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
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
    layer = FusedMoE(8, 2, 576, 768, True, ParallelContext.single())
    for p in layer.parameters():
        p.data.normal_(0, 0.05)
    prepare_cpu_weights(torch.nn.Sequential(layer), None)
    limit = cpu_ops.MOE_MAX_ROWS

    def once(x: torch.Tensor, fused: bool, n: int) -> float:
        cpu_ops.MOE_MAX_ROWS = 1 << 30 if fused else 0
        for _ in range(3):
            layer(x)
        start = time.perf_counter()
        for _ in range(n):
            layer(x)
        return (time.perf_counter() - start) / n * 1e6

    print(f"one MoE layer, {args.threads} thread(s), us per call (best / median of "
          f"{args.rounds} interleaved rounds); today's limit MOE_MAX_ROWS = {limit}")
    with torch.no_grad():
        for rows in (int(r) for r in args.rows.split(",")):
            x, n = torch.randn(rows, 576), max(10, 200 // rows)
            runs: dict[bool, list[float]] = {False: [], True: []}
            for _ in range(args.rounds):
                for fused in (False, True):
                    runs[fused].append(once(x, fused, n))
            torch_path, fused_path = sorted(runs[False]), sorted(runs[True])
            mid = args.rounds // 2
            print(f"rows {rows:4d}: torch path {torch_path[0]:8.1f} / {torch_path[mid]:8.1f}  "
                  f"moe_forward {fused_path[0]:8.1f} / {fused_path[mid]:8.1f}  "
                  f"ratio (best) {fused_path[0] / torch_path[0]:.2f}")
    cpu_ops.MOE_MAX_ROWS = limit


if __name__ == "__main__":
    main()
