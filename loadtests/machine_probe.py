"""The machine's own speed: fixed fp32 matmuls (768x768 @ 768x2048) per second on two threads.
On a shared machine the CPU's speed drifts by 10-30 % over minutes (the 2026-11-28 quiet hour:
53-71 with nothing else running), so the soak and engine_aging report throughput per unit of it.

    .venv/bin/python loadtests/machine_probe.py   # prints one reading (2 s)
"""

from __future__ import annotations

import time

import torch


def probe(seconds: float = 2.0) -> float:
    torch.set_num_threads(2)
    a, b = torch.randn(768, 768), torch.randn(768, 2048)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        a @ b
        n += 1
    return n / (time.perf_counter() - start)


if __name__ == "__main__":
    print(probe())
