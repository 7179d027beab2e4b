"""Single stream against llama.cpp: the same SmolLM2 Q4_1 GGUF, the same prompt tokens, 128
output tokens forced, one request at a time, in the same run.

llama.cpp runs through llama-cpp-python (`make peer-llamacpp` builds it from its sdist into
.venv-llamacpp) in a child process of that venv, which this module starts on itself with
`--serve-llamacpp` and feeds prompts over stdin/stdout (one JSON line each way), so the engines
take turns: every round runs each engine on every prompt, alternating. Shoal runs fp32 and each
`--quantization` from this venv. Both get the same thread count (Shoal's default unless
`--threads`); time per request = prompt + 128 tokens, tok/s = 128 / that.
    make peer-llamacpp && .venv/bin/python -m benchmarks.peer_llamacpp [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
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


def serve_llamacpp(gguf: str, threads: int) -> None:
    """The child: load the GGUF in llama.cpp, answer {"tokens": [...], "n": 128} lines with
    {"seconds": ..., "tokens": [...]}: greedy, `n` tokens whatever they are (EOS included)."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=gguf, n_ctx=1024, n_threads=threads,
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
    def __init__(self, gguf: str, threads: int) -> None:
        if not PEER_PYTHON.exists():
            raise SystemExit(f"{PEER_PYTHON} is missing: run `make peer-llamacpp` first")
        self.proc = subprocess.Popen(
            [str(PEER_PYTHON), str(Path(__file__).resolve()), "--serve-llamacpp", gguf,
             "--threads", str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="int8,int4,gguf")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--prompts", type=int, default=len(QUESTIONS), help="how many of the "
                        f"{len(QUESTIONS)} chat prompts")
    parser.add_argument("--serve-llamacpp", metavar="GGUF", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_llamacpp:
        serve_llamacpp(args.serve_llamacpp, args.threads)
        return
    from benchmarks.offline_throughput import RESULTS
    from shoal.services.engine import LLM, SamplingParams, smollm2_gguf_path
    from shoal.services.engine.runner.cpu_threads import default_cpu_threads

    gguf = str(smollm2_gguf_path())
    threads = args.threads or default_cpu_threads()
    names = ["fp32"] + [q.strip() for q in args.quantization.split(",") if q.strip()]
    shoal = {name: LLM(gguf, device="cpu", dtype="float32", num_threads=threads,
                       quantization="none" if name == "fp32" else name,
                       kv_cache_memory=128 * 2**20) for name in names}
    tokenizer = shoal["fp32"].get_tokenizer()
    prompts = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for q in QUESTIONS[:args.prompts]]
    peer = LlamaCppPeer(gguf, threads)
    params = SamplingParams(temperature=0.0, max_tokens=args.tokens, ignore_eos=True)
    runs: dict[str, list[float]] = {name: [] for name in ["llama.cpp", *names]}
    try:
        for _ in range(args.rounds):
            for prompt in prompts:  # alternating, request by request
                runs["llama.cpp"].append(args.tokens / peer.run(prompt, args.tokens))
                for name, llm in shoal.items():
                    start = time.perf_counter()
                    llm.generate([prompt], params, use_tqdm=False)
                    runs[name].append(args.tokens / (time.perf_counter() - start))
    finally:
        peer.close()
    ref = statistics.median(runs["llama.cpp"])
    print(f"single stream, {args.tokens} tokens forced, {len(prompts)} prompts x {args.rounds} "
          f"rounds, {threads} thread(s) each; llama-cpp-python {peer.info['ready']}")
    result: dict[str, Any] = {"threads": threads, "tokens": args.tokens, "engines": {},
                              "llamacpp_system": peer.info["system"]}
    for name, values in runs.items():
        median = statistics.median(values)
        result["engines"][name] = {"median_tok_s": median, "best_tok_s": max(values),
                                   "runs": values}
        print(f"{name:9s} median {median:6.1f} tok/s  best {max(values):6.1f}  "
              f"shoal/llama.cpp {median / ref:.2f}x")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"peer_llamacpp-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
