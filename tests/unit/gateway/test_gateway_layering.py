"""Every gateway file stays small and opens with its docstring (the pure modules' imports are
checked with the rest of the tree in tests/unit/test_layering.py)."""

from __future__ import annotations

from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[3] / "services" / "gateway"


def test_every_gateway_file_is_small_and_documented() -> None:
    for path in GATEWAY.rglob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 260, path.name
        assert path.name == "__init__.py" or text.startswith('"""'), path.name
