"""Speculative decoding (n-gram) on SmolLM2, offline, same run: output tokens/s with and without
speculation at batch 1 and batch 8, on copy-heavy work (repeat or lightly edit a given text,
rewrite code) and on plain chat, with the acceptance rate per draft position.

Greedy, so both engines produce the same tokens (the benchmark checks it) and only the speed
differs. Rounds alternate baseline and speculation to even out a shared machine; each ratio is
taken within a round, and the median ratio over rounds is reported.
    .venv/bin/python -m benchmarks.spec_decode [--rounds 2] [--max-tokens 96] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"

PASSAGE = ("The gateway accepts OpenAI-style requests and forwards each one to an engine chosen by "
           "the router. Engines run on workers, and a scheduler decides which worker hosts which "
           "model. All services talk over NATS, and the registry keeps its state in Postgres.")
CODE = '''def total_price(items, tax_rate):
    total = 0
    for item in items:
        total += item.price * item.quantity
    return total * (1 + tax_rate)
'''
COPY = [
    f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
    f"Fix the spelling in this text and return it otherwise unchanged:\n\n"
    f"{PASSAGE.replace('accepts', 'acepts').replace('scheduler', 'schedular')}",
    f"Rename the variable `total` to `subtotal` in this Python function and return the whole "
    f"function:\n\n{CODE}",
    f"Summarise this text, quoting its sentences where possible:\n\n{PASSAGE}",
]
CHAT = [
    "Write a short story about a lighthouse keeper.",
    "Give me three tips for learning a new language.",
    "What are the main differences between cats and dogs as pets?",
    "Explain how a bicycle works to a ten-year-old.",
]


def run(llm, prompts: list[str], batch: int, params) -> tuple[float, int, list[list[int]]]:
    """(seconds, output tokens, outputs) for the prompts in groups of `batch`."""
    outputs: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = [[{"role": "user", "content": p}] for p in prompts[i:i + batch]]
        outputs += [o.outputs[0].token_ids for o in llm.chat(group, params, use_tqdm=False)]
    return time.perf_counter() - start, sum(len(o) for o in outputs), outputs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    args = parser.parse_args()

    from shoal.services.engine import LLM, SamplingParams
    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path

    folder = str(prepare_model(str(smollm2_gguf_path())))
    common = dict(max_model_len=1024, kv_cache_memory=256 * 2**20, num_threads=args.num_threads)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    base = LLM(folder, **common)
    spec = LLM(folder, speculative_config=spec_cfg, **common)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    base.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)  # warm up
    spec.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)

    cases = [("copy", COPY, 1), ("chat", CHAT, 1), ("copy", COPY * 2, 8), ("chat", CHAT * 2, 8)]
    results = []
    for name, prompts, batch in cases:
        ratios, rates = [], []
        per_pos: list[float] = []
        for _ in range(args.rounds):
            before = spec.engine.stats().spec_decode
            t_b, n_b, out_b = run(base, prompts, batch, params)
            t_s, n_s, out_s = run(spec, prompts, batch, params)
            after = spec.engine.stats().spec_decode
            assert out_b == out_s, "greedy output differs with speculation"
            ratios.append((n_s / t_s) / (n_b / t_b))
            drafts = after.num_drafts - before.num_drafts
            tokens = after.num_draft_tokens - before.num_draft_tokens
            rates.append((after.num_accepted_tokens - before.num_accepted_tokens) / max(tokens, 1))
            per_pos = [(a - b) / max(drafts, 1) for a, b in
                       zip(after.accepted_per_pos, before.accepted_per_pos or [0] * args.k)]
            print(f"{name} batch {batch}: base {n_b / t_b:.1f} tok/s, spec {n_s / t_s:.1f} tok/s, "
                  f"ratio {ratios[-1]:.2f}, acceptance {rates[-1]:.2f}, drafts {drafts}, "
                  f"accepted per position {[round(x, 2) for x in per_pos]}", flush=True)
        results.append({"workload": name, "batch": batch, "ratios": ratios,
                        "median_ratio": statistics.median(ratios), "acceptance": rates,
                        "accepted_per_pos_last_round": per_pos})
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "spec_decode.json"
    out.write_text(json.dumps({"machine": platform.node(), "args": vars(args),
                               "speculative_config": spec_cfg, "results": results}, indent=2))
    for r in results:
        print(f"{r['workload']:5s} batch {r['batch']}: median ratio {r['median_ratio']:.2f} "
              f"(rounds {[round(x, 2) for x in r['ratios']]})")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
