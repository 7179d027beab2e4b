"""`import shoal` stays light: LLM and SamplingParams resolve lazily, torch loads only for LLM."""

from __future__ import annotations

import subprocess
import sys

import pytest


def run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          timeout=120).stdout.strip()


def test_import_shoal_and_sampling_params_do_not_load_torch():
    assert run("import sys, shoal\nfrom shoal import SamplingParams, StructuredOutputsParams\n"
               "from shoal.services.engine import EngineConfig, SamplingParams as S\n"
               "from shoal.services.engine import StructuredOutputsParams as G\n"
               "assert S is SamplingParams and G is StructuredOutputsParams\n"
               "print('torch' in sys.modules)") == "False"


def test_llm_and_the_engine_exports_resolve():
    out = run("import shoal\nfrom shoal.services import engine\n"
              "print(shoal.LLM is engine.LLM, engine.AsyncEngine.__name__, "
              "engine.RequestOutput.__name__)")
    assert out == "True AsyncEngine RequestOutput"
    with pytest.raises(subprocess.CalledProcessError):
        run("import shoal\nshoal.NoSuchThing")
