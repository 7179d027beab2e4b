"""Single stream against llama.cpp: the same SmolLM2 Q4_1 GGUF, the same prompt tokens, 128
output tokens forced, one request at a time, in the same run.

llama.cpp runs through llama-cpp-python (`make peer-llamacpp` builds it from its sdist into
.venv-llamacpp) in a child process of that venv, which this module starts on itself with
`--serve-llamacpp` and feeds prompts over stdin/stdout (one JSON line each way), so the engines
take turns: every round runs each engine on every prompt, alternating. Shoal runs fp32 and each
`--quantization` from this venv. Both get the same thread count (Shoal's default unless
`--threads`); time per request = prompt + 128 tokens, tok/s = 128 / that.

`--model 1b`: issue 31's 1B Llama instead (random weights, benchmarks/model_1b.py), converted by
llama.cpp's own convert_hf_to_gguf.py and quantised by its quantizer to `--types` (Q8_0,
Q4_K_M); Shoal runs each file's own blocks (`quantization="gguf"`) against llama.cpp
on the same file, one file at a time. `--prefill-len N` adds a prefill workload: one N-token
prompt a round (a new one each round: no cached prefix), one output token: time to first token
and prompt tok/s. Each single-stream figure is also a fraction of the bandwidth bound (the
file's bytes per token / the read bandwidth measured in this run, benchmarks/bound.py).
    make peer-llamacpp && .venv/bin/python -m benchmarks.peer_llamacpp [--rounds 3]
    .venv/bin/python -m benchmarks.peer_llamacpp --model 1b --prefill-len 2048 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "How do I reverse a list in Python?",
]
PEER_PYTHON = Path(".venv-llamacpp/bin/python")


def serve_llamacpp(gguf: str, threads: int, n_ctx: int = 1024) -> None:
    """The child: load the GGUF in llama.cpp, answer {"tokens": [...], "n": 128} lines with
    {"seconds": ..., "tokens": [...]}: greedy, `n` tokens whatever they are (EOS included)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=n_ctx, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    print(json.dumps({"ready": llama_cpp.__version__, "system": llama_cpp.llama_print_system_info()
                      .decode(errors="replace")}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        start = time.perf_counter()
        out = []
        for token in llm.generate(request["tokens"], top_k=1, top_p=1.0, temp=0.0, reset=True):
            out.append(int(token))
            if len(out) == request["n"]:
                break
        print(json.dumps({"seconds": time.perf_counter() - start, "tokens": out}), flush=True)


class LlamaCppPeer:
    def __init__(self, gguf: str, threads: int, python: Path = PEER_PYTHON,
                 n_ctx: int = 1024) -> None:
        if not python.exists():
            raise SystemExit(f"{python} is missing: run `make peer-llamacpp` first")
        self.proc = subprocess.Popen(
            [str(python), str(Path(__file__).resolve()), "--serve-llamacpp", gguf,
             "--threads", str(threads), "--n-ctx", str(n_ctx)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the llama.cpp child exited")
        return json.loads(line)

    def run(self, tokens: list[int], n: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokens": tokens, "n": n}) + "\n")
        self.proc.stdin.flush()
        answer = self._read()
        assert len(answer["tokens"]) == n
        return float(answer["seconds"])

    def close(self) -> None:
        if self.proc.stdin:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)


def chat_prompts(tokenizer: Any, count: int) -> list[list[int]]:
    return [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for q in QUESTIONS[:count]]


def shoal_weight_bytes(name: str, gguf: Path, folder: Path) -> float:
    """What a single-stream step of Shoal's `name` setting reads (bound.py): the file's own
    blocks for `gguf`, the model's weights at int8 / int4 / fp32 width otherwise."""
    from benchmarks.bound import (BYTES_PER_WEIGHT, gguf_tensor_bytes, hf_tensor_bytes,
                                  weight_bytes_per_token)

    tied = bool(json.loads((folder / "config.json").read_text()).get("tie_word_embeddings"))
    if name == "gguf":
        return weight_bytes_per_token(gguf_tensor_bytes(gguf), tied)
    width = BYTES_PER_WEIGHT.get(name, BYTES_PER_WEIGHT.get(name.replace("fp", "float"), 4.0))
    return weight_bytes_per_token(hf_tensor_bytes(folder, width), tied)


def run_file(args: argparse.Namespace, label: str, gguf: Path, names: list[str],
             threads: int) -> dict[str, Any]:
    """Shoal's settings `names` and llama.cpp on one file, alternating, in the same rounds."""
    import numpy as np

    from shoal.services.engine import LLM, SamplingParams, prepare_model

    n_ctx = max(1024, args.prefill_len + 64)
    # (float32: the GGUF path checks its blocks against the fp32 conversion; a bf16 build fails
    # that check, and the blocks' matmuls take bf16 activations whatever the dtype)
    shoal = {name: LLM(str(gguf), device="cpu", dtype="float32",
                       num_threads=threads, quantization="none" if name == "fp32" else name,
                       kv_cache_memory=256 * 2**20, max_model_len=n_ctx) for name in names}
    prompts = chat_prompts(next(iter(shoal.values())).get_tokenizer(), args.prompts)
    vocab = next(iter(shoal.values())).engine.runner.vocab_size
    peer = LlamaCppPeer(str(gguf), threads, args.peer_python, n_ctx)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    engines = ["llama.cpp", *names]
    runs: dict[str, list[float]] = {name: [] for name in engines}
    ttft: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for rnd in range(args.rounds):
            for prompt in prompts:  # alternating, request by request
                runs["llama.cpp"].append(args.tokens / peer.run(prompt, args.tokens))
                for name, llm in shoal.items():
                    start = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                    runs[name].append(args.tokens / (time.perf_counter() - start))
            if args.prefill_len:  # a new prompt each round: no prefix cached anywhere
                rng = np.random.default_rng([args.seed, rnd])
                long = rng.integers(100, vocab - 100, args.prefill_len).tolist()
                ttft["llama.cpp"].append(peer.run(long, 1))
                for name, llm in shoal.items():
                    start = time.perf_counter()
                    llm.generate([long], first, use_tqdm=False)
                    ttft[name].append(time.perf_counter() - start)
    finally:
        peer.close()
        for llm in shoal.values():
            llm.shutdown()
    folder = prepare_model(str(gguf))
    out: dict[str, Any] = {"file": str(gguf), "llamacpp": peer.info["ready"], "engines": {}}
    ref = statistics.median(runs["llama.cpp"])
    ref_ttft = statistics.median(ttft["llama.cpp"]) if ttft["llama.cpp"] else 0.0
    for name in engines:
        weights = shoal_weight_bytes("gguf" if name == "llama.cpp" else name, gguf, folder)
        median = statistics.median(runs[name])
        entry = {"median_tok_s": median, "best_tok_s": max(runs[name]), "runs": runs[name],
                 "ratio_vs_llamacpp": median / ref, "weight_bytes": weights}
        if ttft[name]:
            entry["ttft_s"] = statistics.median(ttft[name])
            entry["ttft_runs"] = ttft[name]
            entry["prefill_tok_s"] = args.prefill_len / entry["ttft_s"]
            entry["prefill_ratio_vs_llamacpp"] = ref_ttft / entry["ttft_s"]
        out["engines"][name] = entry
    return out


def report(result: dict[str, Any]) -> None:
    """One line per file and engine; the bound at the best bandwidth this run measured."""
    bandwidth = max(result["bandwidth"]["best"], result["bandwidth_end"]["best"])
    print(f"\nbandwidth bound at {bandwidth / 1e9:.1f} GB/s (the best read this run)")
    for label, file in result["files"].items():
        report_file(label, file, result["prefill_len"], bandwidth)


def report_file(label: str, file: dict[str, Any], prefill_len: int, bandwidth: float) -> None:
    """A file's lines: printed as soon as it is done too (a 1B file takes minutes to load)."""
    from benchmarks.bound import fraction_of_bound

    for name, entry in file["engines"].items():
        entry["fraction_of_bound"] = fraction_of_bound(entry["median_tok_s"],
                                                       entry["weight_bytes"], bandwidth)
        line = (f"{label:14s} {name:9s} median {entry['median_tok_s']:6.1f} tok/s  best "
                f"{entry['best_tok_s']:6.1f}  x llama.cpp {entry['ratio_vs_llamacpp']:.2f}  "
                f"{100 * entry['fraction_of_bound']:.0f}% of the bound "
                f"({entry['weight_bytes'] / 1e9:.2f} GB a token)")
        if "ttft_s" in entry:
            line += (f"; prefill {prefill_len}: TTFT "
                     f"{1000 * entry['ttft_s']:.0f} ms, {entry['prefill_tok_s']:.0f} prompt "
                     f"tok/s, x llama.cpp {entry['prefill_ratio_vs_llamacpp']:.2f}")
        print(line, flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="`1b` (issue 31's, random weights, "
                        "converted and quantised by llama.cpp); default: the shipped SmolLM2 Q4_1")
    parser.add_argument("--types", default="Q8_0,Q4_K_M", help="with --model 1b: llama.cpp "
                        "ftypes to quantise to")
    parser.add_argument("--quantization", default=None, help="Shoal's settings on each file "
                        "(default int8,int4,gguf; with --model 1b gguf); fp32 runs too unless 1b")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many of the "
                        f"{len(QUESTIONS)} chat prompts")
    parser.add_argument("--prefill-len", type=int, default=0, help="add a prefill workload of "
                        "this many prompt tokens (0: none)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                        help="llama-cpp-python's venv python (default ./.venv-llamacpp)")
    parser.add_argument("--convert-python", type=Path, default=None,
                        help="with --model 1b: the converter's python (model_1b.py)")
    parser.add_argument("--serve-llamacpp", metavar="GGUF", help=argparse.SUPPRESS)
    parser.add_argument("--n-ctx", type=int, default=1024, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_llamacpp:
        serve_llamacpp(args.serve_llamacpp, args.threads, args.n_ctx)
        return
    from benchmarks.bound import measure_bandwidth
    from benchmarks.offline_throughput import RESULTS
    from shoal.services.engine import smollm2_gguf_path
    from shoal.services.engine.runner.cpu_threads import default_cpu_threads

    threads = args.threads or default_cpu_threads()
    big = args.model == "1b"
    quants = args.quantization if args.quantization is not None else (
        "gguf" if big else "int8,int4,gguf")
    names = ([] if big else ["fp32"]) + [q.strip() for q in quants.split(",") if q.strip()]
    if big:
        from benchmarks.model_1b import CONVERT_PYTHON, make_1b, make_gguf

        folder = make_1b()
        files = {f"1B {kind}": make_gguf(folder, kind, args.peer_python, threads=threads,
                                         convert_python=args.convert_python or CONVERT_PYTHON)
                 for kind in args.types.split(",")}
    else:
        files = {"SmolLM2 Q4_1": smollm2_gguf_path()}
    bandwidth = measure_bandwidth()
    load = os.getloadavg()
    print(f"single stream, {args.tokens} tokens forced, {args.prompts} prompts x {args.rounds} "
          f"rounds, {threads} thread(s) each; read bandwidth {bandwidth['one_thread'] / 1e9:.1f} "
          f"GB/s (1 thread), {bandwidth['two_threads'] / 1e9:.1f} GB/s (2); load "
          f"{load[0]:.1f}", flush=True)
    result: dict[str, Any] = {"threads": threads, "tokens": args.tokens, "bandwidth": bandwidth,
                              "prefill_len": args.prefill_len, "load_start": load, "files": {}}
    for label, gguf in files.items():
        result["files"][label] = run_file(args, label, Path(gguf), names, threads)
        report_file(label, result["files"][label], args.prefill_len, bandwidth["best"])
    result["load_end"] = os.getloadavg()
    again = measure_bandwidth()  # a busy machine reads slower: the bound is the best seen
    result["bandwidth_end"] = again
    report(result)
    print("load average at start {:.1f} {:.1f} {:.1f}, at end {:.1f} {:.1f} {:.1f}".format(
        *result["load_start"], *result["load_end"]))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"peer_llamacpp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"written {path}")


if __name__ == "__main__":
    main()
