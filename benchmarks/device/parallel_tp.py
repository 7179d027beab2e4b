"""The device run behind benchmarks/parallel_throughput.py's TP=8 estimate (Llama-3-70B on 8
H100s): measure the two terms the estimate assumes.

1. Compute: one TP=8 rank's share of a Llama-3-70B forward (per layer: qkv 8192->1280, o
   1024->8192, gate_up 8192->7168, down 3584->8192, in bf16; times 80 layers) at a 64-sequence
   decode step and a 2048-token prefill chunk, on one GPU.
2. Communication, with 2 or more GPUs: NCCL all-reduce of [tokens, 8192] bf16 across every
   visible GPU (one process per GPU), time per call and bus bandwidth (2 (n-1)/n x bytes / t).
   With one GPU this part is skipped and says so.

    python3 benchmarks/device/parallel_tp.py --out results.json   (bash run.sh parallel)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import tempfile
import time
from pathlib import Path

import torch

LAYERS, HIDDEN, TP = 80, 8192, 8
SHARD = {"qkv": (HIDDEN, (64 + 2 * 8) * 128 // TP), "o": (64 * 128 // TP, HIDDEN),
         "gate_up": (HIDDEN, 2 * 28672 // TP), "down": (28672 // TP, HIDDEN)}
TOKENS = {"decode_64_seqs": 64, "prefill_2048_tokens": 2048}


def _time(fn, reps: int = 20) -> float:  # type: ignore[no-untyped-def]
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps


def compute_per_rank() -> dict:
    weights = {k: torch.randn(o, i, device="cuda", dtype=torch.bfloat16)
               for k, (i, o) in SHARD.items()}
    out = {}
    for name, tokens in TOKENS.items():
        xs = {k: torch.randn(tokens, i, device="cuda", dtype=torch.bfloat16)
              for k, (i, _) in SHARD.items()}

        def layer() -> None:
            for k, w in weights.items():
                torch.nn.functional.linear(xs[k], w)

        out[name] = {"matmul_ms_per_forward": 1e3 * LAYERS * _time(layer)}
    return out


def _allreduce_rank(rank: int, world: int, port: int, result: str) -> None:
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    figures = {}
    for name, tokens in TOKENS.items():
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        per = _time(lambda: dist.all_reduce(x), reps=50)
        size = x.numel() * x.element_size()
        figures[name] = {"bytes": size, "us": per * 1e6,
                         "busbw_GBps": 2 * (world - 1) / world * size / per / 1e9,
                         "ms_per_forward_160_calls": 160 * per * 1e3}
    if rank == 0:
        Path(result).write_text(json.dumps(figures))
    dist.destroy_process_group()


def allreduce(world: int) -> dict:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_allreduce_rank, args=(world, port, f.name), nprocs=world)
        return json.loads(Path(f.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "."))
                        / "parallel_tp.json")
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    report = {"gpu": torch.cuda.get_device_name(0), "gpus": gpus,
              "compute_tp8_rank": compute_per_rank()}
    report["nccl_allreduce"] = (allreduce(gpus) if gpus >= 2 else
                                "skipped: one GPU (NCCL needs a GPU per rank)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
