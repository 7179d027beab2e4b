"""The quantised matmul kernels at 1B-like shapes, old against new against fp32 / bf16, same run.

- decode (`--rows 1`): for each GGUF type (random blocks) the fp32 block matmul
  (`gguf_matmul`: blocks unpacked to floats, "old") against the int8-activation VNNI one
  (`gguf_matmul_q8`, activations per 32, "new") and, for Q4_K / Q6_K, the one with activations
  per 256 and the scales applied in integers (`gguf_matmul_q8k`, "q8k"), for Q4_K, Q6_K, Q8_0
  their packed layout (`gguf_matmul_packed`, "packed"; the bytes counted as stored), Shoal's int8
  (`torch._weight_int8pack_mm` against `int8_matmul_q8`),
  the fp32 C++ GEMV and oneDNN's bf16 kernel over the same shape: ms a matmul and GB/s of
  weight bytes (the weight's stored size / time) and that as a fraction of the read bandwidth
  measured on as many threads (benchmarks/bound.py), in interleaved rounds (best of each).
- batches (`--rows 8,16,32,64`): the same kernels against what a quantised layer runs from
  MANY_ROWS rows (dequantise the step's weight to bf16, then oneDNN's GEMM, for GGUF; a
  prepacked bf16 GEMM for int8 / int4): where the integer kernel stops winning.
- prefill (`--prefill`): 512-2048 tokens through each quantised layer's many-rows path
  against a bf16 layer's prepacked GEMM.

    .venv/bin/python -m benchmarks.gguf_kernels [--threads 1,2] [--rows 1] [--shape 4096x2048]
    .venv/bin/python -m benchmarks.gguf_kernels --prefill [--tokens 512,2048]
On one thread the times are the thread's CPU time (other processes' load does not count), on
two wall time: print `uptime` beside them.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import torch
import torch.nn.functional as F

from shoal.kernels import cpu_ops

# ggml type id -> (name, weights a block, bytes a block, byte offsets of fp16 scales)
TYPES = {8: ("Q8_0", 32, 34, (0,)), 12: ("Q4_K", 256, 144, (0, 2)),
         13: ("Q5_K", 256, 176, (0, 2)), 14: ("Q6_K", 256, 210, (208,)),
         2: ("Q4_0", 32, 18, (0,)), 3: ("Q4_1", 32, 20, (0, 2))}


def random_blocks(ggml_type: int, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    _, qk, size, scales = TYPES[ggml_type]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows, cols // qk, size), dtype=np.uint8)
    for offset in scales:
        d = rng.uniform(-0.02, 0.02, (rows, cols // qk)).astype(np.float16)
        raw[..., offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // qk, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def timed(fn: Callable[[], object]) -> float:
    """Seconds `fn` took: its thread's CPU time on one thread (the kernels then run inline, and
    other processes' load does not count), else wall time."""
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    start = clock()
    fn()
    return clock() - start


def interleaved(kernels: dict[str, Callable[[], object]], rounds: int, inner: int
                ) -> dict[str, float]:
    """Best seconds per call of each kernel, the kernels taking turns round by round."""
    best = {name: float("inf") for name in kernels}
    for fn in kernels.values():
        fn()
    for _ in range(rounds):
        for name, fn in kernels.items():
            best[name] = min(best[name], timed(lambda: [fn() for _ in range(inner)]) / inner)
    return best


STREAM_BYTES = 96 << 20
"""Each kernel cycles through copies of its weight totalling this much (3x this machine's L3),
so every call reads its weight from memory, as a model's layers do."""


def cycling(make: Callable[[int], Callable[[], object]], size: int) -> Callable[[], object]:
    """One call of `make(i)`'s kernels per call, i cycling over enough copies to leave cache."""
    calls = [make(i) for i in range(max(1, -(-STREAM_BYTES // size)))]
    position = [0]

    def call() -> object:
        position[0] = (position[0] + 1) % len(calls)
        return calls[position[0]]()
    return call


def kernels_for(n: int, k: int, rows: int, ops: torch._ops._OpNamespace
                ) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (call, weight bytes) for [n, k] weights and `rows` rows of x."""
    from shoal.services.engine.layers.cpu_weights import _per_row_int8

    x = torch.randn(rows, k)
    xb = x.to(torch.bfloat16)
    out: dict[str, tuple[Callable[[], object], int]] = {}

    def add(name: str, size: int, make: Callable[[int], Callable[[], object]]) -> None:
        out[name] = (cycling(make, size), size)

    def dense(i: int) -> torch.Tensor:
        return torch.randn(n, k, generator=torch.Generator().manual_seed(i)) * 0.02

    if rows <= cpu_ops.GEMV_MAX_ROWS:
        add("fp32 GEMV", n * k * 4, lambda i: partial(cpu_ops.gemv, x, dense(i), None))
    add("bf16 oneDNN", n * k * 2, lambda i: partial(
        torch.ops.mkldnn._linear_pointwise, xb,
        torch.ops.mkldnn._reorder_linear_weight(dense(i).to(torch.bfloat16)), None, "none", [],
        ""))

    def int8(i: int, new: bool) -> Callable[[], object]:
        qweight, scale = _per_row_int8(dense(i))
        if new:
            return partial(ops.int8_matmul_q8, x, qweight, scale.to(torch.bfloat16).float())
        return partial(torch._weight_int8pack_mm, xb, qweight, scale.to(torch.bfloat16))

    add("int8 old", n * k, lambda i: int8(i, False))
    if rows < 8:  # Shoal's int4 (a Q4_1 file's blocks run as it): torch's kernel
        from shoal.services.engine.layers.cpu_weights import Int4Linear

        add("int4 torch", n * k // 2 + n * k // 32 * 4, lambda i: partial(
            Int4Linear(dense(i), None), x))
    if hasattr(ops, "int8_matmul_q8"):
        add("int8 new", n * k, lambda i: int8(i, True))
    for t, (name, *_rest) in TYPES.items():
        size = random_blocks(t, 1, k).numel() * n
        if rows < 8:
            add(f"{name} old", size, lambda i, t=t: partial(ops.gguf_matmul, x,
                                                            random_blocks(t, n, k, i), t))
        else:  # the many-rows path of GGUFBlockLinear today
            add(f"{name} old", size, lambda i, t=t: (lambda b: lambda: F.linear(
                xb, ops.gguf_dequantize(b, t, k, torch.bfloat16)))(random_blocks(t, n, k, i)))
        if hasattr(ops, "gguf_matmul_q8"):
            add(f"{name} new", size, lambda i, t=t: partial(ops.gguf_matmul_q8, x,
                                                            random_blocks(t, n, k, i), t))
        if t in Q8K_TYPES and hasattr(ops, "gguf_matmul_q8k"):
            add(f"{name} q8k", size, lambda i, t=t: partial(ops.gguf_matmul_q8k, x,
                                                            random_blocks(t, n, k, i), t))
        if cpu_ops.packed_available(t, k):
            add(f"{name} packed", size, lambda i, t=t: partial(
                ops.gguf_matmul_packed, x, ops.gguf_repack(random_blocks(t, n, k, i), t), t, n))
    return out


Q8K_TYPES = {12, 14}
"""Types with the per-256 activation kernel (`gguf_matmul_q8k`), printed as `<type> q8k`."""


def decode(args: argparse.Namespace) -> None:
    from benchmarks.bound import read_bandwidth

    ops = torch.ops.shoal_cpu
    n, k = (int(v) for v in args.shape.split("x"))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bandwidth = read_bandwidth(threads)
        print(f"-- read bandwidth, {threads} threads: {bandwidth / 1e9:.1f} GB/s")
        for rows in (int(r) for r in args.rows.split(",")):
            kernels = kernels_for(n, k, rows, ops)
            best = interleaved({name: fn for name, (fn, _) in kernels.items()}, args.rounds,
                               args.inner)
            print(f"-- {n}x{k}, {rows} rows, {threads} threads")
            for name, (_, size) in kernels.items():
                kind, _, variant = name.rpartition(" ")
                old = best.get(f"{kind} old")
                ratio = ""
                if variant in ("new", "q8k", "packed") and old is not None:
                    ratio = f"  {old / best[name]:.2f}x old"
                for before in ("new", "q8k"):
                    if variant in ("q8k", "packed") and variant != before and \
                            f"{kind} {before}" in best:
                        ratio += f"  {best[f'{kind} {before}'] / best[name]:.2f}x {before}"
                rate = size / best[name]
                print(f"{name:12s} {best[name] * 1e3:8.3f} ms  {rate / 1e9:6.1f} GB/s"
                      f"  {rate / bandwidth:4.0%} of read{ratio}")


def prefill(args: argparse.Namespace) -> None:
    """Each quantised layer kind's many-rows call against bf16's, at prefill sizes."""
    from shoal.services.engine.layers.cpu_weights import Int4Linear, Int8Linear, OneDNNLinear
    from shoal.services.engine.layers.gguf_weights import GGUFBlockLinear

    torch.set_num_threads(int(args.threads.split(",")[-1]))
    for shape in ("2048x2048", "8192x2048", "2048x8192"):
        n, k = (int(v) for v in shape.split("x"))
        dense = torch.randn(n, k) * 0.02
        layers: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "bf16": OneDNNLinear(dense.to(torch.bfloat16), None),
            "int8": Int8Linear(dense, None), "int4": Int4Linear(dense, None)}
        for t in (8, 12, 14):  # unpacked each step, and from a kept bf16 copy
            layers[TYPES[t][0]] = GGUFBlockLinear([(t, random_blocks(t, n, k))], k, None)
            layers[f"{TYPES[t][0]} kept"] = kept = GGUFBlockLinear(
                [(t, random_blocks(t, n, k))], k, None)
            kept.keep_many_rows()
        for tokens in (int(v) for v in args.tokens.split(",")):
            x = torch.randn(tokens, k).to(torch.bfloat16)
            best = interleaved({name: (lambda f=f: f(x)) for name, f in layers.items()},
                               args.rounds, 1)
            line = "  ".join(f"{name} {best[name] * 1e3:.1f} ms ({best['bf16'] / best[name]:.2f}x)"
                             for name in layers)
            print(f"{shape} {tokens} tokens: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--rows", default="1")
    parser.add_argument("--shape", default="4096x2048", help="N x K (output x input)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--inner", type=int, default=5)
    parser.add_argument("--prefill", action="store_true")
    parser.add_argument("--tokens", default="512,2048")
    args = parser.parse_args()
    if not cpu_ops.load():
        raise SystemExit("the C++ CPU ops could not be built")
    prefill(args) if args.prefill else decode(args)


if __name__ == "__main__":
    main()
