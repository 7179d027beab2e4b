"""The engine's docstrings name real code: a type named in a code span (`...`) of a docstring is
defined somewhere in the tree (outputs.py once promised a `SeqUpdate` that never existed)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
TYPE_NAME = re.compile(r"\b([A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+)\b")
"""CamelCase with at least two humps: SchedulerOutput, not EOS or Sequence."""


def defined_names() -> set[str]:
    names: set[str] = set()
    for folder in ("services", "shared", "kernels", "shoal"):
        for path in (ROOT / folder).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(node.name)
                elif isinstance(node, ast.Assign):
                    names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return names


def test_types_named_in_engine_docstrings_exist() -> None:
    defined = defined_names()
    missing = []
    for path in sorted((ROOT / "services" / "engine").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                     ast.AsyncFunctionDef)):
                continue
            for span in re.findall(r"`([^`]+)`", ast.get_docstring(node) or ""):
                missing += [f"{path.relative_to(ROOT)}: {name} in `{span}`"
                            for name in TYPE_NAME.findall(span) if name not in defined]
    assert not missing, missing
