"""Shoal's version, read once from the installed package's metadata (pyproject.toml is the one
place it is written): `shoal --version`, /version, the NATS micro services and the OpenAPI
document all report this."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

try:
    VERSION = version("shoal")
except PackageNotFoundError:  # a source tree that was never installed
    VERSION = "0.0.0+unknown"
