"""Importing the policy loads no network module, and its files stay small (the source-level import
rule is checked with the rest of the tree in tests/unit/test_layering.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3] / "services" / "scheduler"
PURE = [ROOT / "policies", ROOT / "claim", ROOT / "planner.py"]
FORBIDDEN = ("nats", "aiohttp", "sqlalchemy", "asyncpg")


def _files() -> list[Path]:
    out: list[Path] = []
    for p in PURE:
        out += sorted(p.rglob("*.py")) if p.is_dir() else [p]
    return out


def test_importing_the_policy_loads_no_network_module() -> None:
    code = ("import sys; import shoal.services.scheduler.planner; "
            f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]; "
            "print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


def test_policy_files_stay_small() -> None:
    for path in _files():
        lines = path.read_text().splitlines()
        assert len(lines) <= 300, f"{path} has {len(lines)} lines"
        assert lines[0].startswith('"""'), f"{path} lacks its opening docstring"
