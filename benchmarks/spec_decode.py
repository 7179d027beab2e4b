"""Speculative decoding (n-gram) on SmolLM2, offline, same run: output tokens/s with and without
speculation at batch 1 and batch 8, on copy-heavy work (repeat or lightly edit a given text,
rewrite code) and on plain chat, with the acceptance rate per draft position.

Three engines stay loaded: no speculation, n-gram speculation, and n-gram speculation switched
off from batch 8 (`disable_by_batch_size`). Greedy, so all produce the same tokens (checked) and
only the speed differs. Each batch of prompts runs through the engines back to back (the order
flips every round) to even out a shared machine; ratios are taken within a round, and the median
over rounds is reported.
    .venv/bin/python -m benchmarks.spec_decode [--rounds 3] [--max-tokens 64] [--k 4]
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


def chat(llm, prompts: list[str], params) -> tuple[float, list[list[int]]]:
    """(seconds, output token ids) for one group of prompts run as one batch."""
    group = [[{"role": "user", "content": p}] for p in prompts]
    start = time.perf_counter()
    outs = llm.chat(group, params, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]


def run_pair(engines: dict, prompts: list[str], batch: int, params, flip: bool) -> dict:
    """Each group of `batch` prompts through every engine back to back (order flipped per
    round), so a shared machine's drift hits all of them alike. -> name: (seconds, tokens)."""
    totals = {name: [0.0, 0] for name in engines}
    names = list(engines)[::-1] if flip else list(engines)
    for i in range(0, len(prompts), batch):
        outs = {}
        for name in names:
            seconds, outs[name] = chat(engines[name], prompts[i:i + batch], params)
            totals[name][0] += seconds
            totals[name][1] += sum(len(o) for o in outs[name])
        first = outs[names[0]]
        assert all(o == first for o in outs.values()), "greedy output differs with speculation"
    return totals


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--lookup-max", type=int, default=4)
    parser.add_argument("--lookup-min", type=int, default=2)
    parser.add_argument("--num-threads", type=int, default=None)
    parser.add_argument("--disable-at", type=int, default=8,
                        help="disable_by_batch_size of the third engine")
    args = parser.parse_args()

    from shoal.services.engine import LLM, SamplingParams
    from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path

    folder = str(prepare_model(str(smollm2_gguf_path())))
    common = dict(max_model_len=1024, kv_cache_memory=256 * 2**20, num_threads=args.num_threads)
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k,
                "prompt_lookup_max": args.lookup_max, "prompt_lookup_min": args.lookup_min}
    engines = {"base": LLM(folder, **common),
               "spec": LLM(folder, speculative_config=spec_cfg, **common),
               "spec_switch_off": LLM(folder, speculative_config={
                   **spec_cfg, "disable_by_batch_size": args.disable_at}, **common)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    for llm in engines.values():  # warm up
        llm.chat([{"role": "user", "content": "Hi"}], params, use_tqdm=False)

    cases = [("copy", COPY, 1), ("chat", CHAT, 1), ("copy", COPY * 2, 8), ("chat", CHAT * 2, 8)]
    results = []
    for name, prompts, batch in cases:
        rounds = []
        for r in range(args.rounds):
            before = engines["spec"].engine.stats().spec_decode
            totals = run_pair(engines, prompts, batch, params, flip=r % 2 == 1)
            after = engines["spec"].engine.stats().spec_decode
            drafts = after.num_drafts - before.num_drafts
            tokens = after.num_draft_tokens - before.num_draft_tokens
            tok_s = {n: t[1] / t[0] for n, t in totals.items()}
            row = {"tok_s": tok_s,
                   "ratio": tok_s["spec"] / tok_s["base"],
                   "ratio_with_switch_off": tok_s["spec_switch_off"] / tok_s["base"],
                   "acceptance": (after.num_accepted_tokens - before.num_accepted_tokens)
                   / max(tokens, 1),
                   "drafts": drafts,
                   "accepted_per_pos": [round((a - b) / max(drafts, 1), 3) for a, b in zip(
                       after.accepted_per_pos, before.accepted_per_pos or [0] * args.k)]}
            rounds.append(row)
            print(f"{name} batch {batch}: " + ", ".join(f"{n} {v:.1f}" for n, v in tok_s.items())
                  + f" tok/s; spec/base {row['ratio']:.2f}, switch-off/base "
                  f"{row['ratio_with_switch_off']:.2f}, acceptance {row['acceptance']:.2f}, "
                  f"accepted per position {row['accepted_per_pos']}", flush=True)
        results.append({"workload": name, "batch": batch, "rounds": rounds,
                        "median_ratio": statistics.median(r["ratio"] for r in rounds),
                        "median_ratio_with_switch_off": statistics.median(
                            r["ratio_with_switch_off"] for r in rounds)})
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "spec_decode.json"
    out.write_text(json.dumps({"machine": platform.node(), "args": vars(args),
                               "speculative_config": spec_cfg, "results": results}, indent=2))
    for r in results:
        print(f"{r['workload']:5s} batch {r['batch']}: spec/base median {r['median_ratio']:.2f} "
              f"(rounds {[round(x['ratio'], 2) for x in r['rounds']]}), with "
              f"disable_by_batch_size={args.disable_at}: {r['median_ratio_with_switch_off']:.2f}")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
