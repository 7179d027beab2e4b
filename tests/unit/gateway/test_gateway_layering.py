"""The gateway's pure modules (routing policy, protocol, response building, SSE framing, admission)
import no network or database library (DESIGN.md "Rules")."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[3] / "services" / "gateway"
PURE = ["router.py", "protocol.py", "responses.py", "streaming.py", "admission.py", "structured.py",
        "tools.py", "tool_parsers.py"]
FORBIDDEN = {"nats", "aiohttp", "sqlalchemy", "asyncpg"}


@pytest.mark.parametrize("name", PURE)
def test_pure_module_imports(name: str) -> None:
    tree = ast.parse((GATEWAY / name).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & FORBIDDEN


def test_every_gateway_file_is_small_and_documented() -> None:
    for path in GATEWAY.glob("*.py"):
        text = path.read_text()
        assert len(text.splitlines()) <= 260, path.name
        assert path.name == "__init__.py" or text.startswith('"""'), path.name
