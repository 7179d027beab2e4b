"""EngineCore with structured outputs over the fake runner: a request waits outside the scheduler
until its grammar is compiled, then runs carrying it; a bad spec is refused at add time; an
abort while compiling ends the request; unconstrained requests are not held up, and an engine
that never sees a constrained request never loads xgrammar."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import xgrammar as xgr

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.engine_core import EngineCore
from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams
from shoal.services.engine.structured_output.compiler import GrammarCompiler
from shoal.shared.errors import InvalidRequest
from tests.unit.engine.engine_helpers import EOS, VOCAB, CharTokenizer, FakeRunner

JSON = StructuredOutputsParams(json={"type": "object"})


def make_core(gate: threading.Event | None = None) -> EngineCore:
    """A core whose grammar compiler waits for `gate` before its first compile."""
    runner = FakeRunner(num_kv_blocks=64, block_size=4)
    core = EngineCore(EngineConfig(model="fake", block_size=4), runner=runner,
                      tokenizer=CharTokenizer())

    def make_info() -> xgr.TokenizerInfo:
        if gate is not None:
            assert gate.wait(30)
        vocab = [f"<{i}>" if i == EOS else chr(ord("a") + i % 26) for i in range(VOCAB)]
        return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, stop_token_ids=[EOS])

    core.grammar_gate.compiler = GrammarCompiler(make_info)
    return core


def test_a_constrained_request_waits_for_its_grammar_then_runs_with_it() -> None:
    gate = threading.Event()
    core = make_core(gate)
    core.add_request("free", [1, 2], SamplingParams(max_tokens=3))
    core.add_request("json", [1, 2], SamplingParams(max_tokens=3, structured_outputs=JSON))
    assert core.stats().num_waiting == 2
    core.step()
    assert core.stats().num_waiting == 1  # still compiling; the free request runs meanwhile
    scheduled = {s.seq_id for out in core.runner.steps for s in out.scheduled}
    assert scheduled == {0}
    gate.set()
    while core.has_unfinished():
        core.step()
    grammars = {s.seq_id: s.sampling_params.compiled_grammar for out in core.runner.steps
                for s in out.scheduled}
    assert grammars[0] is None and isinstance(grammars[1], xgr.CompiledGrammar)


def test_bad_spec_is_refused_at_add_time_and_nothing_is_queued() -> None:
    core = make_core()
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(regex="(ab"))
    with pytest.raises(InvalidRequest) as err:
        core.add_request("r", [1, 2], bad)
    assert err.value.param == "structured_outputs.regex"
    assert not core.has_unfinished() and core.grammar_gate.compiler.num_compiled == 0


def test_abort_while_compiling_ends_the_request() -> None:
    gate = threading.Event()
    core = make_core(gate)
    core.add_request("json", [1, 2], SamplingParams(n=2, structured_outputs=JSON))
    output = core.abort("json")
    assert output is not None and output.finished
    assert [c.finish_reason for c in output.outputs] == ["abort", "abort"]
    gate.set()
    assert not core.has_unfinished() and core.step() == []


def test_a_failed_compile_ends_its_request_and_the_engine_goes_on() -> None:
    core = make_core()

    def broken_info() -> xgr.TokenizerInfo:
        raise RuntimeError("no vocabulary")

    core.grammar_gate.compiler = GrammarCompiler(broken_info)
    core.add_request("json", [1, 2], SamplingParams(max_tokens=2, structured_outputs=JSON))
    core.add_request("free", [1, 2], SamplingParams(max_tokens=2))
    finished = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                finished[out.request_id] = out.outputs[0].finish_reason
    assert finished == {"json": "abort", "free": "length"}


def test_one_compile_serves_every_request_with_the_same_spec() -> None:
    core = make_core()
    for i in range(4):
        core.add_request(str(i), [1, 2], SamplingParams(max_tokens=2, structured_outputs=JSON))
    while core.has_unfinished():
        core.step()
    assert core.grammar_gate.compiler.num_compiled == 1


def test_an_engine_without_constrained_requests_never_loads_xgrammar() -> None:
    code = (
        "import sys, torch\n"
        "from tests.unit.engine.engine_helpers import CharTokenizer, FakeRunner\n"
        "from shoal.services.engine.config import EngineConfig\n"
        "from shoal.services.engine.core.engine_core import EngineCore\n"
        "from shoal.services.engine.runner.sampler import SeqState, sample\n"
        "from shoal.services.engine.sampling_params import SamplingParams\n"
        "core = EngineCore(EngineConfig(model='fake', block_size=4), runner=FakeRunner(\n"
        "    block_size=4), tokenizer=CharTokenizer())\n"
        "core.add_request('r', [1, 2], SamplingParams(max_tokens=3))\n"
        "while core.has_unfinished():\n"
        "    core.step()\n"
        "state = SeqState(params=SamplingParams(temperature=0), token_ids=[1], prompt_len=1)\n"
        "sample(torch.zeros(2, 8), [state, state], frozenset())\n"
        "print('xgrammar' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[3], check=True)
    assert out.stdout.strip() == "False"
