"""DESIGN.md "Rules": domain logic imports no nats, aiohttp or sqlalchemy (checked on the source)."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PURE = ["services/worker/engine", "kernels", "services/scheduler/policies", "shared/states.py",
        "shared/errors.py", "services/worker/devices.py"]
FORBIDDEN = ("nats", "aiohttp", "sqlalchemy", "asyncpg")


def _python_files(entry: str) -> list[Path]:
    path = ROOT / entry
    return [path] if path.suffix == ".py" else sorted(path.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("entry", PURE)
def test_domain_code_has_no_network_imports(entry: str) -> None:
    files = _python_files(entry)
    if not files:
        pytest.skip(f"{entry} has no files yet")
    offenders = {str(f.relative_to(ROOT)): sorted(_imports(f) & set(FORBIDDEN)) for f in files}
    assert not {f: bad for f, bad in offenders.items() if bad}


def test_no_top_level_shared_services_kernels_package_is_installed() -> None:
    """Only `shoal` is importable from the install (the HF `kernels` package must stay free)."""
    probe = (
        "import importlib.util, json; "
        "print(json.dumps({n: getattr(importlib.util.find_spec(n), 'origin', None) "
        "for n in ('shared', 'services', 'kernels')}))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd="/", capture_output=True, text=True, check=True)
    origins = json.loads(out.stdout)
    assert all(origin is None or str(ROOT) not in origin for origin in origins.values()), origins
    import shoal.kernels
    import shoal.services
    import shoal.shared

    assert Path(shoal.shared.__file__).parent == ROOT / "shared"
    assert Path(shoal.kernels.__file__).parent == ROOT / "kernels"
