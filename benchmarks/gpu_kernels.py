"""The GPU measurement of issue 7 in one call: device bandwidth, each Triton kernel against its
ceiling (bytes moved / measured bandwidth), then the engine on a Llama-3-8B-shaped model with
random bf16 weights (benchmarks/gpu_engine.py). Prints JSON and writes it to --out.

    .venv/bin/python -m benchmarks.gpu_kernels [--out PATH] [--skip-kernels | --skip-engine]
                                               [--skip-transformers] [--smoke]

On a lent GPU machine (no venv of ours there) use benchmarks/device/run.sh instead.

`--smoke` runs every step on tiny shapes on the CPU (Triton interpreter) to check the plumbing.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def bench_ms(fn: Callable[[], Any], device: torch.device) -> float:
    """Median milliseconds per call (CUDA: triton's do_bench, which flushes L2 between calls)."""
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=25, rep=100, return_mode="median"))
    fn()
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def device_bandwidth(device: torch.device, num_bytes: int) -> float:
    """Bytes/s of a device-to-device copy (read + write counted)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src), device)
    return 2 * num_bytes / (ms * 1e-3)


def _row(name: str, ms: float, num_bytes: int, bandwidth: float, **extra: Any) -> dict[str, Any]:
    achieved = num_bytes / (ms * 1e-3)
    return {"kernel": name, "ms": round(ms, 4), "bytes": num_bytes,
            "GB/s": round(achieved / 1e9, 1),
            "fraction_of_bandwidth": round(achieved / bandwidth, 3), **extra}


def kernel_benchmarks(device: torch.device, bandwidth: float, smoke: bool) -> list[dict[str, Any]]:
    from shoal.kernels.paged_attention_split_k import num_splits_for
    from shoal.kernels.paged_attention_triton import paged_attention_triton
    from shoal.kernels.reshape_and_cache_triton import reshape_and_cache_triton
    from shoal.kernels.rms_norm_triton import rms_norm_triton
    from shoal.kernels.rotary import rope_inv_freq, rotary_cos_sin
    from shoal.kernels.rotary_triton import apply_rotary_triton

    dtype = torch.float16 if smoke else torch.bfloat16
    num_heads, num_kv_heads, head_dim, hidden = (4, 2, 16, 64) if smoke else (32, 8, 128, 4096)
    block_size, item = 16, dtype.itemsize
    rows: list[dict[str, Any]] = []
    # reshape_and_cache: read k, v and the slots, write k, v
    for num_tokens in ([8] if smoke else [256, 4096, 16384]):
        num_blocks = num_tokens // block_size + 8
        cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype,
                            device=device)
        v_cache = torch.zeros_like(cache)
        kv = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
        slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]
        ms = bench_ms(lambda: reshape_and_cache_triton(kv, kv, cache, v_cache, slots), device)
        moved = 4 * kv.numel() * item + slots.numel() * 8
        rows.append(_row("reshape_and_cache", ms, moved, bandwidth, num_tokens=num_tokens))
    # paged_attention decode: K and V of every context read once (q and out are negligible)
    cases = [(2, 64)] if smoke else [(1, 4096), (1, 16384), (8, 4096), (8, 16384), (64, 4096),
                                     (256, 4096), (64, 1024)]
    for num_seqs, ctx in cases:
        blocks_per_seq = -(-ctx // block_size)
        cache = torch.randn(num_seqs * blocks_per_seq, block_size, num_kv_heads, head_dim,
                            device=device).to(dtype)
        v_cache = torch.randn_like(cache)
        tables = torch.randperm(num_seqs * blocks_per_seq, device=device).to(torch.int32)
        tables = tables.view(num_seqs, blocks_per_seq)
        seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
        qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device=device)
        q = torch.randn(num_seqs, num_heads, head_dim, device=device).to(dtype)
        moved = 2 * num_seqs * ctx * num_kv_heads * head_dim * item
        splits = num_splits_for(num_seqs, blocks_per_seq * block_size)
        for forced in sorted({1, splits}):
            ms = bench_ms(lambda: paged_attention_triton(
                q, cache, v_cache, tables, seq_lens, qsl, head_dim ** -0.5, num_splits=forced),
                device)
            rows.append(_row("paged_attention_decode", ms, moved, bandwidth, num_seqs=num_seqs,
                             context=ctx, num_splits=forced, chosen_by_rule=forced == splits))
        cache = v_cache = None  # frees the caches before the next case (the lambdas use them)
    # fused residual + RMSNorm (read x, residual, weight; write out, residual) and rotary
    num_tokens = 8 if smoke else 4096
    x = torch.randn(num_tokens, hidden, device=device).to(dtype)
    w = torch.ones(hidden, device=device, dtype=dtype)
    ms = bench_ms(lambda: rms_norm_triton(x, w, 1e-5, x), device)
    rows.append(_row("rms_norm_residual", ms, 4 * x.numel() * item, bandwidth,
                     num_tokens=num_tokens))
    inv_freq = rope_inv_freq({"rope_theta": 500000.0}, head_dim, 8192)
    cos_sin = rotary_cos_sin(inv_freq, 8192).to(device)  # [8192, head_dim] float32
    q = torch.randn(num_tokens, num_heads, head_dim, device=device).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, device=device).to(dtype)
    positions = torch.randint(0, 8192, (num_tokens,), device=device)
    ms = bench_ms(lambda: apply_rotary_triton(q, k, positions, cos_sin), device)
    moved = 2 * (q.numel() + k.numel()) * item + num_tokens * head_dim * 4
    rows.append(_row("rotary", ms, moved, bandwidth, num_tokens=num_tokens))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/gpu_kernels.json")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="engine figures only (a lent machine's 10-minute call: split the run)")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter")
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        print("no CUDA device: the GPU benchmark needs one (run it where a GPU is lent; "
              "--smoke checks the plumbing on the CPU)", file=sys.stderr)
        return 2
    else:
        device = torch.device("cuda")
    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (smoke)",
        "torch": torch.__version__}
    bandwidth = device_bandwidth(device, (1 << 20) if args.smoke else (2 << 30))
    result["bandwidth_GB/s"] = round(bandwidth / 1e9, 1)
    if not args.skip_kernels:
        result["kernels"] = kernel_benchmarks(device, bandwidth, args.smoke)
        print(json.dumps(result, indent=1), flush=True)
    if not args.skip_engine:
        from benchmarks.gpu_engine import engine_benchmarks

        result["engine"] = engine_benchmarks(device, bandwidth, args.smoke,
                                             not args.skip_transformers)
    text = json.dumps(result, indent=1)
    print(text)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
