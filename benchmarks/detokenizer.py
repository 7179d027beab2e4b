"""Incremental detokenization per token: the engine's IncrementalDetokenizer (tokenizers'
DecodeStream) against the hand-written one it replaced (prefix/read offsets, a window of tokens
re-decoded in Python per token), read from git at BASELINE_REV. Same tokenizer (SmolLM2), same
text with multi-byte characters, a stop string held back; alternating runs, medians.

    .venv/bin/python -m benchmarks.detokenizer
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from shoal.services.engine.core.detokenizer import IncrementalDetokenizer
from shoal.services.engine.frontend.tokenizer import load_tokenizer
from shoal.services.engine.model_prep import prepare_model, smollm2_gguf_path
from shoal.services.engine.sampling_params import SamplingParams

BASELINE_REV = "13cff74"
"""The last commit with the hand-written detokenizer."""
TEXT = "The capital of France is Paris. Ünïcödé 🐟 naïve café — 東京は日本の首都です。 " * 40


def baseline(rev: str) -> ModuleType:
    source = subprocess.run(["git", "show", f"{rev}:services/engine/detokenizer.py"],
                            capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "baseline_detokenizer.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location("baseline_detokenizer", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(cls: type, tokenizer: object, prompt: list[int], ids: list[int]) -> tuple[str, float]:
    start = time.perf_counter()
    detok = cls(tokenizer, prompt, SamplingParams(max_tokens=16, stop=["zzz"]))
    deltas = []
    for token_id in ids:
        detok.update([token_id])
        deltas.append(detok.take_delta())
    detok.finish()
    deltas.append(detok.take_delta())
    return "".join(deltas), (time.perf_counter() - start) / len(ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--baseline-rev", default=BASELINE_REV)
    args = parser.parse_args()
    tokenizer = load_tokenizer(prepare_model(str(smollm2_gguf_path())))
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    prompt = tokenizer.encode("Hello there, tell me about Paris.", add_special_tokens=False)
    old = baseline(args.baseline_rev).IncrementalDetokenizer
    times: dict[str, list[float]] = {"hand-written": [], "DecodeStream": []}
    for _ in range(args.rounds):
        for name, cls in (("hand-written", old), ("DecodeStream", IncrementalDetokenizer)):
            text, per_token = run(cls, tokenizer, prompt, ids)
            if text != tokenizer.decode(ids):
                sys.exit(f"{name} decoded differently")
            times[name].append(per_token)
    old_s, new_s = (statistics.median(times[k]) for k in ("hand-written", "DecodeStream"))
    print(f"{len(ids)} tokens, {args.rounds} alternating rounds, medians:")
    print(f"  hand-written (rev {args.baseline_rev}): {old_s * 1e6:6.2f} us/token")
    print(f"  DecodeStream:                {new_s * 1e6:6.2f} us/token   ({old_s / new_s:.1f}x)")


if __name__ == "__main__":
    main()
