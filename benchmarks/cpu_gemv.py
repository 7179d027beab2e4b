"""The matmuls of one decode step at 1-4 rows (or any: `--rows`): Shoal's packed-panel matmul
(`cpu_ops.panel_matmul`, what the fp32 Linears run up to PANEL_MAX_ROWS rows) and its older
plain-layout GEMV (1-2 rows) against oneDNN's packed kernel and torch's F.linear (MKL), over a
model's worth of weights, with the machine's read bandwidth.

At batch 1 a step reads every weight once, so what matters is how close a kernel's bytes per
second come to a plain sum over the same bytes. The layers are SmolLM2-135M's shapes by default
(30 x qkv / o / gate_up / down, and the 49,152-row LM head: 538 MB of fp32), each its own tensor,
so nothing stays in cache between steps. Prints ms per step, GB/s and each kernel's time against
oneDNN's, all from the same run.

    .venv/bin/python -m benchmarks.cpu_gemv [--threads 2] [--rows 1,2,3,4] [--no-mkl]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from shoal.kernels import cpu_ops

SMOLLM2 = {"hidden": 576, "qkv": 960, "intermediate": 1536, "layers": 30, "vocab": 49152}


def best_seconds(fn: Callable[[], object], repeat: int = 7, inner: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for _ in range(inner):
            fn()
        best = min(best, (time.perf_counter() - start) / inner)
    return best


def model_weights(shape: dict[str, int]) -> list[torch.Tensor]:
    h, i = shape["hidden"], shape["intermediate"]
    per_layer = [(shape["qkv"], h), (h, h), (2 * i, h), (h, i)]
    weights = [torch.randn(n, k) for _ in range(shape["layers"]) for n, k in per_layer]
    return weights + [torch.randn(shape["vocab"], h)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--rows", default="1,2,3,4")
    parser.add_argument("--no-mkl", action="store_true", help="skip F.linear (the slow one)")
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("the C++ CPU ops could not be built")
    torch.set_num_threads(args.threads)
    weights = model_weights(SMOLLM2)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    flat = torch.randn(nbytes // 4)
    read = nbytes / best_seconds(flat.sum)
    print(f"{len(weights)} weights, {nbytes / 1e6:.0f} MB fp32, {args.threads} threads; "
          f"a plain sum reads {read / 1e9:.1f} GB/s")
    packed = [torch.ops.mkldnn._reorder_linear_weight(w) for w in weights]
    panels = [cpu_ops.dense_pack(w) for w in weights]
    for rows in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(rows, k) for k in {w.shape[1] for w in weights}}
        kernels: dict[str, Callable[[], None]] = {
            "oneDNN packed": lambda: [torch.ops.mkldnn._linear_pointwise(
                xs[w.shape[1]], p, None, "none", [], "") for w, p in zip(weights, packed)],
            "Shoal panels": lambda: [cpu_ops.panel_matmul(xs[w.shape[1]], p, None, w.shape[0])
                                     for w, p in zip(weights, panels)],
        }
        if not args.no_mkl:
            kernels["F.linear (MKL)"] = lambda: [F.linear(xs[w.shape[1]], w) for w in weights]
        if rows <= cpu_ops.GEMV_MAX_ROWS:
            kernels["Shoal GEMV"] = lambda: [cpu_ops.gemv(xs[w.shape[1]], w, None)
                                             for w in weights]
        times = {name: best_seconds(fn) for name, fn in kernels.items()}
        for name, seconds in times.items():
            print(f"rows {rows}  {name:15s} {seconds * 1e3:7.2f} ms/step  "
                  f"{nbytes / seconds / 1e9:5.1f} GB/s  {seconds / times['oneDNN packed']:.2f}x "
                  "oneDNN's time")


if __name__ == "__main__":
    main()
