"""An engine's start on a .gguf file: from its blocks folder (the default for quantization
"gguf": the Linear weights stay in the file) against the complete float32 conversion (the path
before), each in a fresh process with a fresh cache, then again with the cache; seconds to the
first answer's start, peak RSS, cache bytes on disk, and the same greedy tokens on both.

    .venv/bin/python -m benchmarks.gguf_start \
        --gguf ~/.cache/shoal/bench-models/llama-1b-random-s0-Q4_K_M.gguf
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = ("complete", "blocks")


def start(mode: str, gguf: str, cache: Path) -> dict[str, object]:
    """One start in this process (run by `main` in a child)."""
    from shoal.services.engine.config import EngineConfig
    from shoal.services.engine.frontend.llm import LLM
    from shoal.services.engine.frontend.tokenizer import load_tokenizer
    from shoal.services.engine.model_prep import prepare_model
    from shoal.services.engine.runner.model_runner import ModelRunner
    from shoal.services.engine.sampling_params import SamplingParams

    began = time.perf_counter()
    args = {"device": "cpu", "kv_cache_memory": 256 * 2**20, "max_model_len": 512,
            "cache_dir": str(cache)}
    if mode == "blocks":
        llm = LLM(gguf, **args)
    else:
        full = prepare_model(gguf, cache_dir=cache)
        llm = LLM(gguf, runner=ModelRunner(EngineConfig(model=gguf, **args), full),
                  tokenizer_obj=load_tokenizer(full), **args)
    seconds = time.perf_counter() - began
    out = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8),
                       use_tqdm=False)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    return {"seconds": seconds, "peak_gib": peak,
            "disk_gib": sum(f.stat().st_size for f in cache.rglob("*") if f.is_file()) / 2**30,
            "tokens": out[0].outputs[0].token_ids}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--cache", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(start(args.child, args.gguf, Path(args.cache))))
        return
    results: dict[tuple[str, str], dict] = {}
    with tempfile.TemporaryDirectory(prefix="gguf-start-") as tmp:
        for run in ("first", "cached"):
            for mode in MODES:
                print(f"{mode}, {run} start ...", flush=True)
                done = subprocess.run([sys.executable, "-m", "benchmarks.gguf_start", "--gguf",
                                       args.gguf, "--child", mode, "--cache", f"{tmp}/{mode}"],
                                      capture_output=True, text=True, check=True)
                results[mode, run] = json.loads(done.stdout.strip().splitlines()[-1])
    same = results["blocks", "first"]["tokens"] == results["complete", "first"]["tokens"]
    print(f"\n{Path(args.gguf).name}: same greedy tokens: {same}")
    print("| run | complete s | blocks s | ratio | complete peak GiB | blocks peak GiB | ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for run in ("first", "cached"):
        c, b = results["complete", run], results["blocks", run]
        print(f"| {run} | {c['seconds']:.1f} | {b['seconds']:.1f} | "
              f"{b['seconds'] / c['seconds']:.2f}x | {c['peak_gib']:.2f} | {b['peak_gib']:.2f} | "
              f"{b['peak_gib'] / c['peak_gib']:.2f}x |")
    print(f"cache on disk: complete {results['complete', 'cached']['disk_gib']:.2f} GiB, "
          f"blocks {results['blocks', 'cached']['disk_gib']:.2f} GiB")


if __name__ == "__main__":
    main()
