"""An engine gives back the heap a large prompt left behind (issue 24: SmolLM2's engine grew from
2.6 to 4.4 GB over a campaign of bad inputs and stayed there). Tokenizing a 2.5 MB prompt (the
largest SmolLM2 takes at its 8192 context) on the thread that answers /tokenize left this
process about 230 MB larger after two of them, freed memory glibc kept; the engine now trims it
after every large prompt. Real SmolLM2 tokenizer, this process's RSS."""

from __future__ import annotations

from types import SimpleNamespace

import psutil
import pytest

from shoal.services.engine.frontend.tokenizer import load_tokenizer
from shoal.services.engine.input_processor import InputProcessor
from shoal.services.engine.model_prep import prepare_model
from shoal.services.engine.server.handlers import EngineHandlers
from shoal.services.engine.server.heap import TRIM_AFTER_BYTES, trim_after
from shoal.shared.schemas.infer import TokenizeRequest

pytestmark = pytest.mark.slow
MIB = 2**20


def test_a_large_prompt_leaves_no_heap_behind(gguf: str) -> None:
    core = SimpleNamespace(max_model_len=8192, config=SimpleNamespace(chat_template=None))
    inputs = InputProcessor(tokenizer=load_tokenizer(prepare_model(gguf)), max_model_len=8192,
                            max_token_bytes=162)
    h = EngineHandlers(bus=None, engine=SimpleNamespace(core=core),  # type: ignore[arg-type]
                       instance_id="i", model_name="m", inputs=inputs)
    text = ("lorem ipsum dolor sit amet " * 100_000)[:2_500_000]
    process = psutil.Process()
    h.lookups.submit(h.tokenize, TokenizeRequest(model="m", prompt="warm up")).result()
    before = process.memory_info().rss
    for _ in range(2):
        reply = h.lookups.submit(h.tokenize, TokenizeRequest(model="m", prompt=text)).result()
        assert reply.count > 900_000
        del reply
    grown = (process.memory_info().rss - before) / MIB
    assert grown < 100, f"{grown:.0f} MiB kept after two 2.5 MB prompts"


def test_only_large_inputs_trim() -> None:
    assert not trim_after(TRIM_AFTER_BYTES - 1)
