"""Multi-LoRA batches, offline on SmolLM2: 32 concurrent requests spread over 8 adapters against
the same 32 on the base model, same process, same run (issue 29's target: the LoRA batch at most
1.3x the base batch's time).

The adapters are random PEFT adapters (init_lora_weights=False, rank 8 on q/k/v/o and
gate/up/down: every projection of every layer), made once in a temporary folder. Both batches
generate a fixed number of tokens (ignore_eos, greedy), so they do the same base-model work and
only the adapters differ; runs alternate to even out a shared machine, the best of each is kept.
Needs peft (the test extra).
    .venv/bin/python -m benchmarks.lora_batch [--num-requests 32] [--num-adapters 8]
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: Path, folder: Path, num: int, rank: int) -> list[Path]:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = []
    for i in range(num):
        torch.manual_seed(i)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        config = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                            lora_dropout=0.0, init_lora_weights=False)
        get_peft_model(model, config).save_pretrained(folder / f"adapter-{i}")
        paths.append(folder / f"adapter-{i}")
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    from shoal.services.engine import LLM, LoRARequest, SamplingParams
    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path

    base = prepare_model(str(smollm2_gguf_path()))
    with tempfile.TemporaryDirectory() as tmp:
        paths = make_adapters(base, Path(tmp), args.num_adapters, args.rank)
        llm = LLM(str(base), device="cpu", dtype="float32", num_threads=args.threads,
                  max_num_seqs=args.num_requests, num_kv_blocks=64 * args.num_requests // 8,
                  enable_lora=True, max_loras=args.num_adapters, max_lora_rank=args.rank,
                  enable_prefix_caching=False)
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(p)) for i, p in enumerate(paths)]
        prompts = [f"Write a short note about topic number {i}." for i in range(args.num_requests)]
        spread = [loras[i % len(loras)] for i in range(args.num_requests)]
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(prompts[:2], params, use_tqdm=False, lora_request=spread[:2])  # warm-up
        for lora in loras:
            llm.add_lora(lora)  # loaded (host memory) before timing, as a served engine has them
        best = {"base": float("inf"), "lora": float("inf")}
        for _ in range(args.repeats):
            for name, batch_loras in (("base", None), ("lora", spread)):
                start = time.perf_counter()
                outs = llm.generate(prompts, params, use_tqdm=False, lora_request=batch_loras)
                best[name] = min(best[name], time.perf_counter() - start)
                assert all(len(o.outputs[0].token_ids) == args.max_tokens for o in outs)
        llm.shutdown()
    num_tokens = args.num_requests * args.max_tokens
    result = {
        "machine": platform.processor() or platform.machine(), "threads": args.threads,
        "num_requests": args.num_requests, "num_adapters": args.num_adapters,
        "rank": args.rank, "max_tokens": args.max_tokens,
        "base_s": best["base"], "lora_s": best["lora"],
        "base_tokens_per_s": num_tokens / best["base"],
        "lora_tokens_per_s": num_tokens / best["lora"],
        "lora_over_base_time": best["lora"] / best["base"],
    }
    print(f"{args.num_requests} requests x {args.max_tokens} tokens; {args.num_adapters} "
          f"adapters of rank {args.rank} on every projection")
    print(f"base {best['base']:7.2f} s  {result['base_tokens_per_s']:7.1f} tok/s")
    print(f"lora {best['lora']:7.2f} s  {result['lora_tokens_per_s']:7.1f} tok/s   "
          f"lora/base time {result['lora_over_base_time']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "lora_batch.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
