"""One seed for every test's random draws, so a failure can be replayed.

Before each test, conftest.py seeds Python's `random`, torch and numpy (those already imported)
with the run's seed: `SHOAL_TEST_SEED` (an integer), `random` for a fresh one drawn once per run,
or `DEFAULT_SEED`. The seed is shown in pytest's header and in every failure's report
("SHOAL_TEST_SEED=<n> replays it"). Tests that want their own stream call `fresh_generator()`.
"""

from __future__ import annotations

import os
import random
import secrets
import sys
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ENV = "SHOAL_TEST_SEED"
DEFAULT_SEED = 20251127
REPORT_SECTION = "shoal test seed"


@cache
def run_seed() -> int:
    """The seed of this run (read once: `random` draws one seed for the whole run)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return DEFAULT_SEED
    if raw.lower() == "random":
        return secrets.randbelow(2**32)
    try:
        return int(raw)
    except ValueError:
        raise SystemExit(f"{ENV} must be an integer or 'random', got {raw!r}") from None


def seed_everything(seed: int) -> None:
    """Seed the global generators a test may draw from (only modules already imported: a
    gateway test never pays for importing torch)."""
    random.seed(seed)
    if "torch" in sys.modules:
        sys.modules["torch"].manual_seed(seed)
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed % 2**32)


def fresh_generator() -> torch.Generator:
    """A torch generator for one test's data, drawn from the test's seeded torch RNG: the same
    for the same seed, and a new stream on each call within a test."""
    import torch

    return torch.Generator().manual_seed(int(torch.randint(0, 2**62, ())))


def replay_hint(seed: int) -> str:
    return f"{ENV}={seed} replays this test's random draws"
