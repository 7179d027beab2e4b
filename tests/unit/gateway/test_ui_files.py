"""The dashboard's files: every one is packaged (pyproject's package-data), every module they
import exists, and none of them loads anything from another host (no CDN at run time)."""

from __future__ import annotations

import re
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from shoal.services.gateway.management.ui import STATIC

ROOT = Path(__file__).resolve().parents[3]
FILES = sorted(p for p in STATIC.rglob("*") if p.is_file())
IMPORT = re.compile(r'^import .*? from "(\.[^"]+)";$', re.MULTILINE)
URL = re.compile(r"https?://(?!www\.w3\.org/2000/svg)[^\s\"'`)]+")


def test_every_file_is_package_data() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["shoal.services.gateway.management"]
    assert FILES
    for path in FILES:
        rel = path.relative_to(STATIC.parent).as_posix()
        assert any(fnmatch(rel, g) and rel.count("/") == g.count("/") for g in globs), rel


def test_every_import_resolves() -> None:
    modules = [p for p in FILES if p.suffix == ".js"]
    for path in modules:
        for target in IMPORT.findall(path.read_text()):
            assert (path.parent / target).resolve().is_file(), f"{path.name} imports {target}"


def test_nothing_is_fetched_from_another_host() -> None:
    for path in FILES:
        if path.suffix in (".html", ".js", ".css", ".svg"):
            text = path.read_text()
            found = [u for u in URL.findall(text) if "127.0.0.1" not in u]
            assert not found, f"{path.name}: {found}"
