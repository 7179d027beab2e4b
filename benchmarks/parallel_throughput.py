"""What tensor and pipeline parallelism cost on this CPU machine, and what TP=8 would cost on
8 H100s, in one run:

1. The same offline workload (random-token prompts, fixed output lengths, greedy, ignore_eos)
   through `LLM` at TP=1, TP=2 and PP=2 (and TP=2 x PP=2 with --with-2x2), each after a warm-up,
   on a random-weight Llama-shaped model whose heads divide by 2 (SmolLM2's 9 heads do not).
   Output and total tokens/s, each as a ratio to TP=1, and the greedy tokens checked equal.
2. Rank 0's collectives during that run (CommStats): all-reduces and all-gathers per step and
   the mean time of each, the stage hand-off (send of hidden + residual), the step broadcast.
3. A microbenchmark of one gloo all-reduce and one send/recv between two processes at the
   decode (8 tokens) and prefill (512 tokens) sizes of this model's hidden states.
4. A paper estimate: Llama-3-70B at TP=8 on 8 H100 SXM (NVLink 4), per decode step and per
   prefill chunk: 2 all-reduces per layer x 80 layers, ring all-reduce bytes 2 (n-1)/n x size,
   at an assumed NCCL bus bandwidth and per-call latency, against the step's compute / weight
   read time. The device run that would measure it: benchmarks/device/run.sh parallel.

    .venv/bin/python -m benchmarks.parallel_throughput [--num-requests 16] [--with-2x2]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).parent / "results"
BENCH_MODEL = dict(vocab_size=8192, hidden_size=768, intermediate_size=2048, num_hidden_layers=8,
                   num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048)


def make_model(folder: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.tiny_models import tokenizer_dir

    torch.manual_seed(0)
    cfg = LlamaConfig(**BENCH_MODEL, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((tokenizer_dir() / name).read_bytes())
    return folder


def workload(num: int, seed: int) -> tuple[list[list[int]], list[int]]:
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(64), 0.6, num), 8, 256).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(32), 0.5, num), 8, 96).astype(int)
    prompts = [rng.integers(100, BENCH_MODEL["vocab_size"] - 100, int(p)).tolist()
               for p in prompt_lens]
    return prompts, [int(o) for o in output_lens]


def run_engine(model: Path, tp: int, pp: int, prompts: list[list[int]],
               outputs: list[int], threads: int | None = None) -> dict:
    from shoal.services.engine.frontend.llm import LLM
    from shoal.services.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    start = time.perf_counter()
    with LLM(str(model), device="cpu", dtype="float32", kv_cache_memory=1 << 28,
             tensor_parallel_size=tp, pipeline_parallel_size=pp, num_threads=threads) as llm:
        startup = time.perf_counter() - start
        llm.generate([list(range(100, 132))], SamplingParams(temperature=0, max_tokens=4),
                     use_tqdm=False)  # warm-up
        parallel = getattr(llm.engine.runner, "parallel", None)
        if parallel is not None:
            parallel.stats.reset()
        steps = [0]
        llm.engine.on_step_tokens = lambda n: steps.__setitem__(0, steps[0] + 1)
        start = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        comm = {}
        if parallel is not None:
            comm = {op: {"calls": parallel.stats.calls[op],
                         "per_step": parallel.stats.calls[op] / steps[0],
                         "mean_ms": 1e3 * parallel.stats.seconds[op] / parallel.stats.calls[op],
                         "share_of_time": parallel.stats.seconds[op] / elapsed}
                    for op in sorted(parallel.stats.calls)}
    out_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    in_tokens = sum(map(len, prompts))
    return {"tp": tp, "pp": pp, "threads_per_rank": threads or "default", "startup_s": startup,
            "elapsed_s": elapsed, "steps": steps[0],
            "output_tok_s": out_tokens / elapsed, "total_tok_s": (in_tokens + out_tokens) / elapsed,
            "comm": comm, "tokens": [r.outputs[0].token_ids for r in results]}


def _micro_rank(rank: int, port: int, sizes: list[int], hidden: int, reps: int,
                result_file: str) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    figures = {}
    for n in sizes:
        x = torch.randn(n, hidden)
        for op in ("all_reduce", "send_recv"):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                if op == "all_reduce":
                    dist.all_reduce(x)
                elif rank == 0:
                    dist.send(x, 1)
                    dist.recv(x, 1)
                else:
                    dist.recv(x, 0)
                    dist.send(x, 0)
            per = (time.perf_counter() - start) / reps
            figures[f"{op}_{n}x{hidden}_us"] = 1e6 * (per / 2 if op == "send_recv" else per)
    if rank == 0:
        Path(result_file).write_text(json.dumps(figures))
    dist.destroy_process_group()


def microbenchmark(hidden: int, reps: int = 200) -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        mp.spawn(_micro_rank, args=(port, [8, 512], hidden, reps, f.name), nprocs=2)
        return json.loads(Path(f.name).read_text())


def h100_estimate(busbw_gbs: float, latency_us: float, tflops: float, hbm_tbs: float) -> dict:
    """Llama-3-70B (80 layers, hidden 8192, 70.6e9 params, bf16) at TP=8: what the 160
    all-reduces of one forward cost next to the forward itself, per decode step of 64 sequences
    and per 2048-token prefill chunk. Ring all-reduce: each GPU sends and receives
    2 (n-1)/n x size; NCCL's bus bandwidth is what it reaches on that traffic."""
    tp, layers, hidden, params, dtype_bytes = 8, 80, 8192, 70.6e9, 2
    figures = {"assumptions": {"nccl_busbw_GBps": busbw_gbs, "allreduce_latency_us": latency_us,
                               "dense_bf16_TFLOPs_per_gpu": tflops, "hbm_TBps": hbm_tbs}}
    for name, tokens in (("decode_64_seqs", 64), ("prefill_2048_tokens", 2048)):
        size = tokens * hidden * dtype_bytes
        one = latency_us * 1e-6 + 2 * (tp - 1) / tp * size / (busbw_gbs * 1e9)
        comm = 2 * layers * one
        flops = 2 * params * tokens / tp
        weights = params * dtype_bytes / tp
        compute = max(flops / (tflops * 1e12), weights / (hbm_tbs * 1e12))
        figures[name] = {"allreduce_bytes": size, "one_allreduce_us": one * 1e6,
                         "allreduces_per_step": 2 * layers, "allreduce_ms": comm * 1e3,
                         "compute_ms": compute * 1e3,
                         "allreduce_share_unoverlapped": comm / (comm + compute)}
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--with-2x2", action="store_true", help="also TP=2 x PP=2 (4 ranks)")
    parser.add_argument("--busbw", type=float, default=360.0,
                        help="H100 NVLink all-reduce bus bandwidth GB/s (nccl-tests ~360-480)")
    parser.add_argument("--latency-us", type=float, default=10.0)
    parser.add_argument("--tflops", type=float, default=600.0,
                        help="achieved dense bf16 TFLOP/s per H100 (peak 989)")
    parser.add_argument("--hbm", type=float, default=3.0, help="achieved HBM3 TB/s (peak 3.35)")
    parser.add_argument("--out", type=Path, default=RESULTS / "parallel_throughput.json")
    args = parser.parse_args()

    prompts, outputs = workload(args.num_requests, args.seed)
    # TP=1 twice: with its default threads (all cores but one) and with every core, since the
    # parallel runs use every core (one rank per core here)
    cores = len(os.sched_getaffinity(0))
    shapes = [(1, 1, None), (1, 1, cores), (2, 1, None), (1, 2, None)] + (
        [(2, 2, None)] if args.with_2x2 else [])
    with tempfile.TemporaryDirectory() as tmp:
        model = make_model(Path(tmp) / "bench-llama")
        runs = [run_engine(model, tp, pp, prompts, outputs, threads)
                for tp, pp, threads in shapes]
    base, base_tokens = runs[0], runs[0]["tokens"]
    for run in runs:
        run["same_tokens_as_tp1"] = run.pop("tokens") == base_tokens
        run["output_ratio_vs_tp1"] = run["output_tok_s"] / base["output_tok_s"]
    report = {
        "machine": {"cpus": len(os.sched_getaffinity(0)), "processor": platform.processor(),
                    "load_avg": os.getloadavg()},
        "model": BENCH_MODEL, "num_requests": args.num_requests,
        "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
        "runs": runs, "gloo_micro": microbenchmark(BENCH_MODEL["hidden_size"]),
        "h100_tp8_llama3_70b": h100_estimate(args.busbw, args.latency_us, args.tflops, args.hbm),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    for run in runs:
        print(f"TP={run['tp']} PP={run['pp']} threads/rank {run['threads_per_rank']}: "
              f"{run['output_tok_s']:.1f} output tok/s "
              f"({run['output_ratio_vs_tp1']:.2f}x TP=1), {run['total_tok_s']:.1f} total tok/s, "
              f"{run['steps']} steps, same tokens: {run['same_tokens_as_tp1']}")
        for op, c in run["comm"].items():
            print(f"    {op}: {c['per_step']:.1f}/step, {c['mean_ms']:.3f} ms each, "
                  f"{100 * c['share_of_time']:.1f}% of the run")
    print("gloo, 2 processes:", json.dumps({k: round(v, 1) for k, v in
                                            report["gloo_micro"].items()}))
    est = report["h100_tp8_llama3_70b"]
    for name in ("decode_64_seqs", "prefill_2048_tokens"):
        e = est[name]
        print(f"H100 x8 TP=8 Llama-3-70B {name}: {e['allreduces_per_step']} all-reduces of "
              f"{e['allreduce_bytes'] / 2**20:.2f} MiB, {e['one_allreduce_us']:.1f} us each, "
              f"{e['allreduce_ms']:.2f} ms vs {e['compute_ms']:.2f} ms compute "
              f"({100 * e['allreduce_share_unoverlapped']:.0f}% if not overlapped)")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
