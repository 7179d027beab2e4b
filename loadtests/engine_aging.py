"""Does the engine core slow down as it serves thousands of requests? `shoal.LLM` on the bundled
model serves the soak's request (32 chats at once, 64 tokens, temperature 0.7) round after round;
before each round loadtests/machine_probe.py (2 s) reads the machine's own speed, so a slower
machine and a slower engine can be told apart: the rate per unit of probe stays flat unless the
engine itself ages. Not part of `make test`.

    .venv/bin/python -m loadtests.engine_aging [--duration 420] [--model PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from loadtests.machine_probe import probe
from shoal.services.engine.frontend.llm import LLM
from shoal.services.engine.model_prep import smollm2_gguf_path
from shoal.services.engine.sampling_params import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--duration", type=float, default=420.0, help="seconds")
    parser.add_argument("--model", default=None, help="default: the bundled SmolLM2 GGUF")
    args = parser.parse_args()
    torch.set_num_threads(2)
    llm = LLM(args.model or str(smollm2_gguf_path()))
    messages = [[{"role": "user", "content": "Tell me a short story about a river."}]] * 32
    params = SamplingParams(temperature=0.7, max_tokens=64)
    rows: list[tuple[float, float]] = []
    deadline = time.monotonic() + args.duration
    while time.monotonic() < deadline:
        speed = probe()
        started = time.perf_counter()
        outs = llm.chat(messages, params, use_tqdm=False)
        rate = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)
        rows.append((rate, speed))
        print(f"round {len(rows):>3}  served {32 * len(rows):>5}  {rate:7.1f} tok/s  probe "
              f"{speed:5.1f}  per probe {rate / speed:5.2f}", flush=True)
    rows = rows[1:] or rows  # the first round warms the engine up
    tenth = max(1, len(rows) // 6)
    middle = len(rows) // 2 - tenth // 2
    for name, part in (("first", rows[:tenth]), ("middle", rows[middle:middle + tenth]),
                       ("last", rows[-tenth:])):
        print(f"{name:>6} {len(part)} rounds: {statistics.median(r for r, _ in part):.1f} tok/s, "
              f"probe {statistics.median(s for _, s in part):.1f}, per probe "
              f"{statistics.median(r / s for r, s in part):.2f}")
    llm.shutdown()


if __name__ == "__main__":
    main()
