"""Offline throughput: Shoal's LLM vs transformers' static-batch generate on SmolLM2, same run.

A deterministic ShareGPT-like workload (seeded log-normal prompt and output lengths, random
token prompts, fixed output lengths with ignore_eos so both sides do the same work). Reports
output tokens/s for Shoal, transformers at batch 1 and at its best static batch size, and the
fp32 compute ceiling measured here (matmul FLOP/s / (2 x matmul params per token)).
    .venv/bin/python -m benchmarks.offline_throughput [--num-requests 256] [--skip-hf]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

RESULTS = Path(__file__).parent / "results"


@dataclass
class Request:
    prompt_token_ids: list[int]
    output_len: int


def make_workload(num: int, seed: int, vocab: int) -> list[Request]:
    """ShareGPT-like lengths: log-normal, long-tailed, about as many prompt as output tokens
    (ShareGPT's means are ~220 / ~200), scaled down and clipped to keep one run in minutes."""
    rng = np.random.default_rng(seed)
    prompt_lens = np.clip(rng.lognormal(np.log(80), 0.8, num), 8, 512).astype(int)
    output_lens = np.clip(rng.lognormal(np.log(80), 0.6, num), 8, 256).astype(int)
    return [Request(rng.integers(100, vocab - 100, int(p)).tolist(), int(o))
            for p, o in zip(prompt_lens, output_lens)]


def run_shoal(model: str, requests: list[Request], args: argparse.Namespace) -> dict:
    from shoal.services.engine.frontend.llm import LLM
    from shoal.services.engine.sampling_params import SamplingParams

    llm = LLM(model, device="cpu", dtype="float32", num_threads=args.threads,
              kv_cache_memory=int(args.kv_cache_gb * (1 << 30)), max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    llm.generate([list(range(100, 116))], SamplingParams(temperature=0, max_tokens=4),
                 use_tqdm=False)  # warm-up
    params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params, use_tqdm=True)
    elapsed = time.perf_counter() - start
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert num_out == sum(r.output_len for r in requests), "Shoal did not produce every token"
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    stats = llm.engine.stats()
    return {"seconds": elapsed, "output_tokens": num_out, "tokens_per_s": num_out / elapsed,
            "prompt_tokens": num_prompt, "total_tokens_per_s": (num_out + num_prompt) / elapsed,
            "num_preemptions": stats.num_preemptions,
            "num_kv_blocks": llm.engine.runner.num_kv_blocks}


def run_hf_static(hf: torch.nn.Module, requests: list[Request], batch_size: int) -> dict:
    """transformers generate in static batches: left padding, the batch runs to its longest
    output; only the requested tokens count (what a static-batch server delivers)."""
    start = time.perf_counter()
    for b in range(0, len(requests), batch_size):
        batch = requests[b:b + batch_size]
        width = max(len(r.prompt_token_ids) for r in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.int64)
        mask = torch.zeros(len(batch), width, dtype=torch.int64)
        for i, r in enumerate(batch):
            ids[i, width - len(r.prompt_token_ids):] = torch.tensor(r.prompt_token_ids)
            mask[i, width - len(r.prompt_token_ids):] = 1
        new = max(r.output_len for r in batch)
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=0)
        print(f"  transformers batch {batch_size}: {b + len(batch)}/{len(requests)} requests "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
    elapsed = time.perf_counter() - start
    num_out = sum(r.output_len for r in requests)
    return {"batch_size": batch_size, "requests": len(requests), "seconds": elapsed,
            "output_tokens": num_out, "tokens_per_s": num_out / elapsed}


def compute_ceiling(hf: torch.nn.Module) -> dict:
    """Best fp32 matmul FLOP/s over a square GEMM and the model's own MLP shape at 256 tokens."""
    best = 0.0
    for m, k, n in [(1024, 1024, 1024), (256, 576, 3072), (512, 576, 1536)]:
        a, b = torch.randn(m, k), torch.randn(k, n)
        a @ b
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 1.0:
            a @ b
            reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start))
    params = sum(p.numel() for name, p in hf.named_parameters() if p.dim() == 2)  # matmul weights
    return {"matmul_flops": best, "params_per_token": params,
            "tokens_per_s": best / (2 * params)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the shipped SmolLM2 GGUF")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--kv-cache-gb", type=float, default=3.0)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--hf-batch-sizes", default="32,64")
    parser.add_argument("--hf-subset", type=int, default=64, help="requests per batch-size point")
    parser.add_argument("--hf-batch1-requests", type=int, default=4)
    parser.add_argument("--skip-hf", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    from transformers import AutoModelForCausalLM

    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path, tqdm_progress

    source = args.model or str(smollm2_gguf_path())
    folder = prepare_model(source, progress=tqdm_progress())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    requests = make_workload(args.num_requests, args.seed, hf.config.vocab_size)
    num_prompt = sum(len(r.prompt_token_ids) for r in requests)
    print(f"workload: {len(requests)} requests, prompt tokens {num_prompt}, output tokens "
          f"{sum(r.output_len for r in requests)}, threads {args.threads}", flush=True)
    result: dict = {"model": source, "args": vars(args), "machine": platform.processor() or
                    platform.machine(), "cpu_count": os.cpu_count(), "torch": torch.__version__}
    result["ceiling"] = compute_ceiling(hf)
    print(f"fp32 ceiling: {result['ceiling']['matmul_flops'] / 1e9:.1f} GFLOP/s -> "
          f"{result['ceiling']['tokens_per_s']:.1f} tokens/s", flush=True)
    print("Shoal LLM ...", flush=True)
    result["shoal"] = run_shoal(str(folder), requests, args)
    if not args.skip_hf:
        print("transformers batch 1 ...", flush=True)
        result["hf_batch1"] = run_hf_static(hf, requests[:args.hf_batch1_requests], 1)
        subset = requests[:args.hf_subset]
        sweep = [run_hf_static(hf, subset, int(bs)) for bs in args.hf_batch_sizes.split(",")]
        result["hf_sweep"] = sweep
        result["hf_best"] = max(sweep, key=lambda r: r["tokens_per_s"])
    _report(result)


def _report(result: dict) -> None:
    shoal = result["shoal"]["tokens_per_s"]
    ceiling = result["ceiling"]["tokens_per_s"]
    rows = [("Shoal LLM (continuous batching)", shoal, "")]
    if "hf_best" in result:
        b1, best = result["hf_batch1"]["tokens_per_s"], result["hf_best"]
        rows += [("transformers generate, batch 1", b1, f"Shoal x{shoal / b1:.1f}")]
        rows += [(f"transformers generate, static batch {r['batch_size']}", r["tokens_per_s"],
                  f"Shoal x{shoal / r['tokens_per_s']:.2f}") for r in result["hf_sweep"]]
        result["ratios"] = {"shoal_vs_hf_best": shoal / best["tokens_per_s"],
                            "shoal_vs_hf_batch1": shoal / b1}
    rows.append(("fp32 compute ceiling", ceiling, f"Shoal at {100 * shoal / ceiling:.0f}%"))
    # Prompt tokens cost the same matmuls as output tokens: the share of the machine Shoal used.
    work = result["shoal"]["total_tokens_per_s"]
    rows.append(("Shoal prompt + output tokens/s", work, f"{100 * work / ceiling:.0f}% of ceiling"))
    result.setdefault("ratios", {})["shoal_vs_ceiling"] = shoal / ceiling
    result["ratios"]["shoal_work_vs_ceiling"] = work / ceiling
    print(f"\n{'':40s} {'output tok/s':>12s}")
    for name, value, note in rows:
        print(f"{name:40s} {value:12.1f}  {note}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"offline_throughput-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"\nwritten {path}")


if __name__ == "__main__":
    main()
