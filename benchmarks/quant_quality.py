"""What quantised weights cost in quality and buy in speed: SmolLM2 with `quantization=...`
against fp32, same process, same prompts.

- perplexity on a fixed text (the opening of A Tale of Two Cities, public domain; its prompt
  logprobs in windows of 256 tokens)
- greedy agreement: 16 chat prompts x 64 tokens; the share of sequences identical to fp32's and
  the mean length of the common prefix
- speed: output tok/s of one stream and of 64 streams (64 tokens each), fp32 and each
  quantisation alternating, the best of `--rounds`
Every engine loads the same offline SmolLM2 GGUF (Q4_1): fp32 is its dequantised weights, "gguf"
its own blocks, "int8" / "int4" requantise the dequantised weights.
    .venv/bin/python -m benchmarks.quant_quality [--quantization int8,int4,gguf] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import numpy as np

from benchmarks.offline_throughput import RESULTS

TEXT = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the "
    "age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the "
    "season of Light, it was the season of Darkness, it was the spring of hope, it was the winter "
    "of despair, we had everything before us, we had nothing before us, we were all going direct "
    "to Heaven, we were all going direct the other way - in short, the period was so far like the "
    "present period, that some of its noisiest authorities insisted on its being received, for "
    "good or for evil, in the superlative degree of comparison only. There were a king with a "
    "large jaw and a queen with a plain face, on the throne of England; there were a king with a "
    "large jaw and a queen with a fair face, on the throne of France. In both countries it was "
    "clearer than crystal to the lords of the State preserves of loaves and fishes, that things "
    "in general were settled for ever. It was the year of Our Lord one thousand seven hundred "
    "and seventy-five. Spiritual revelations were conceded to England at that favoured period, "
    "as at this. Mrs. Southcott had recently attained her five-and-twentieth blessed birthday, of "
    "whom a prophetic private in the Life Guards had heralded the sublime appearance by "
    "announcing that arrangements were made for the swallowing up of London and Westminster. "
    "France, less favoured on the whole as to matters spiritual than her sister of the shield and "
    "trident, rolled with exceeding smoothness down hill, making paper money and spending it. "
    "Under the guidance of her Christian pastors, she entertained herself, besides, with such "
    "humane achievements as sentencing a youth to have his hands cut off, his tongue torn out "
    "with pincers, and his body burned alive, because he had not kneeled down in the rain to do "
    "honour to a dirty procession of monks which passed within his view, at a distance of some "
    "fifty or sixty yards.")

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "List three prime numbers.",
    "What does a compiler do?", "Give me a tip for learning to cook.",
    "Why is the sky blue?", "Name a famous painting and its painter.",
    "How do I reverse a list in Python?", "What is the boiling point of water?",
    "Describe a cat to someone who has never seen one.", "What is 12 times 12?",
    "Suggest a name for a bakery.", "What causes the seasons on Earth?",
    "Translate 'good morning' into Spanish.", "What is a black hole?",
]


def perplexity(llm: Any, token_ids: list[int], window: int = 256) -> float:
    from shoal.services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    chunks = [token_ids[i:i + window] for i in range(0, len(token_ids) - 1, window)]
    outs = llm.generate(chunks, params, use_tqdm=False)
    lps = [lp.logprob for o in outs for lp in o.prompt_logprobs if lp is not None]
    return math.exp(-sum(lps) / len(lps))


def greedy(llm: Any) -> list[list[int]]:
    from shoal.services.engine import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def speed(llm: Any, batch: int) -> float:
    from shoal.services.engine import SamplingParams

    rng = np.random.default_rng(0)
    prompts = [rng.integers(100, 40000, 16).tolist() for _ in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    return batch * 64 / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quantization", default="int8,int4,gguf",
                        help="comma-separated quantization values, each against fp32")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    from shoal.services.engine import LLM, smollm2_gguf_path

    gguf = str(smollm2_gguf_path())
    names = [q.strip() for q in args.quantization.split(",") if q.strip()]
    llms = {name: LLM(gguf, device="cpu", dtype="float32", num_threads=args.threads,
                      quantization=q, kv_cache_memory=256 * 2**20)
            for name, q in [("fp32", "none")] + [(q, q) for q in names]}
    ids = llms["fp32"].get_tokenizer().encode(TEXT)
    result: dict[str, Any] = {"text_tokens": len(ids), "engines": {}, "greedy": {}}
    tokens = {}
    for name, llm in llms.items():
        tokens[name] = greedy(llm)
        result["engines"][name] = {"settings": llm.engine.runner.settings,
                                   "perplexity": perplexity(llm, ids)}
    ref = tokens["fp32"]
    for name in names:
        quant = tokens[name]
        prefixes = [next((i for i, (a, b) in enumerate(zip(r, q, strict=True)) if a != b),
                         len(r)) for r, q in zip(ref, quant, strict=True)]
        result["greedy"][name] = {"identical": sum(r == q for r, q in zip(ref, quant, strict=True)),
                                  "sequences": len(ref),
                                  "mean_common_prefix": float(np.mean(prefixes))}
    for batch in (1, 64):
        runs: dict[str, list[float]] = {name: [] for name in llms}
        for _ in range(args.rounds):
            for name, llm in llms.items():  # alternating
                runs[name].append(speed(llm, batch))
        for name in llms:
            result["engines"][name][f"tok_s_batch{batch}"] = max(runs[name])
            result["engines"][name][f"tok_s_batch{batch}_runs"] = runs[name]
    base = result["engines"]["fp32"]
    for name, row in result["engines"].items():
        b1, b64 = row["tok_s_batch1"], row["tok_s_batch64"]
        print(f"{name:5s} perplexity {row['perplexity']:.3f}  batch 1 {b1:6.1f} tok/s "
              f"({b1 / base['tok_s_batch1']:.2f}x)  batch 64 {b64:6.1f} tok/s "
              f"({b64 / base['tok_s_batch64']:.2f}x)  [{row['settings']}]")
    for name, g in result["greedy"].items():
        print(f"greedy {name}: {g['identical']}/{g['sequences']} sequences identical to fp32, mean "
              f"common prefix {g['mean_common_prefix']:.1f} of 64 tokens")
    print(f"text {len(ids)} tokens")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"quant_quality-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"written {path}")


if __name__ == "__main__":
    main()
