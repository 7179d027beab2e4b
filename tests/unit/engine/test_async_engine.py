"""AsyncEngine over a fake runner: the event loop stays responsive while the engine steps on
its own thread, streams carry deltas, cancel / early exit / abort() end requests, and a step
failure fails every open stream instead of hanging it."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tests.unit.engine.engine_helpers import CharTokenizer, FakeRunner
from shoal.services.engine.frontend import async_engine
from shoal.services.engine.frontend.async_engine import AsyncEngine
from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.engine_core import EngineCore
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest, Unavailable


def make_engine(step_seconds: float = 0.0, **cfg) -> tuple[AsyncEngine, FakeRunner]:
    runner = FakeRunner(num_kv_blocks=64, block_size=4)
    if step_seconds:
        runner.hook = lambda out: time.sleep(step_seconds)  # a 'model' that takes time
    core = EngineCore(EngineConfig(model="fake", block_size=4, **cfg), runner=runner,
                      tokenizer=CharTokenizer())
    return AsyncEngine(core=core), runner


async def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_streams_deltas_that_add_up_to_the_offline_result():
    engine, _ = make_engine()
    try:
        chunks = [o async for o in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=6))]
        assert chunks[-1].finished and chunks[-1].outputs[0].finish_reason == "length"
        tokens = sum((c.outputs[0].token_ids for c in chunks), [])
        assert len(tokens) == 6
        assert "".join(c.outputs[0].text for c in chunks) == CharTokenizer().decode(tokens)
        assert engine.stats().generation_tokens == 6
    finally:
        engine.shutdown()


async def test_n_children_stream_their_own_deltas():
    engine, _ = make_engine()
    try:
        tokens: dict[int, list[int]] = {0: [], 1: [], 2: []}
        finished: set[int] = set()
        async for out in engine.generate("r", [1, 2, 3, 4, 5],
                                         SamplingParams(n=3, seed=3, max_tokens=4)):
            for c in out.outputs:
                assert c.index not in finished  # nothing after a child's final delta
                tokens[c.index] += c.token_ids
                if c.finish_reason is not None:
                    finished.add(c.index)
        assert finished == {0, 1, 2} and all(len(t) == 4 for t in tokens.values())
        assert len({tuple(t) for t in tokens.values()}) == 3
    finally:
        engine.shutdown()


async def test_event_loop_keeps_ticking_while_the_engine_steps():
    engine, runner = make_engine(step_seconds=0.02)
    step_threads: set[int] = set()
    sleep = runner.hook
    runner.hook = lambda out: (step_threads.add(threading.get_ident()), sleep(out))
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    try:
        start = time.monotonic()
        async for _ in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=15)):
            pass
        elapsed = time.monotonic() - start
        assert elapsed >= 15 * 0.02
        assert ticks >= elapsed / 0.005 / 3  # the loop was free most of the time
        assert threading.get_ident() not in step_threads and len(step_threads) == 1
    finally:
        task.cancel()
        engine.shutdown()


async def test_an_idle_engine_thread_takes_a_request_before_open_returns(monkeypatch):
    """Issue 31 item 6: open() hands an idle engine thread the GIL, so its step starts before the
    loop goes on (to publish the accepted chunk); a busy engine thread is not waited for."""
    monkeypatch.setattr(async_engine, "HANDOVER_S", 5.0)
    engine, runner = make_engine(step_seconds=0.05)
    try:
        await wait_until(lambda: engine._idle)
        first = engine.open("a", [1, 2, 3], SamplingParams(max_tokens=20))
        assert engine._commands == []  # taken by the engine thread before open() returned
        await first.__anext__()  # stepping now: the next open() must not wait for it
        began = time.monotonic()
        second = engine.open("b", [1, 2, 3], SamplingParams(max_tokens=1))
        assert time.monotonic() - began < 0.04
        assert [o.finished async for o in second][-1]
        first.close()
    finally:
        engine.shutdown()


async def test_the_request_after_one_that_left_nothing_running_gets_the_hand_off(monkeypatch):
    """Idle counts from the end of the step that left nothing running (the reader's next request
    may come while the thread still delivers), and the runner's clean-up of finished sequences
    rides on the next step instead of a step of its own competing with that request."""
    monkeypatch.setattr(async_engine, "HANDOVER_S", 5.0)
    engine, runner = make_engine()
    try:
        await wait_until(lambda: engine._idle)
        for i in range(3):
            stream = engine.open(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=1))
            assert engine._commands == []  # taken before open() returned
            assert [o.finished async for o in stream][-1]
            assert engine._idle  # set before the last output was delivered
        assert all(step.scheduled for step in runner.steps)  # no step for clean-up alone
        assert [len(step.finished_seq_ids) for step in runner.steps] == [0, 1, 1]
        assert engine.core.has_unfinished() and not engine.core.has_requests()
    finally:
        engine.shutdown()


async def test_cancelling_the_consumer_aborts_the_request():
    engine, runner = make_engine(step_seconds=0.01)
    got_one = asyncio.Event()

    async def consume() -> None:
        async for _ in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=200)):
            got_one.set()

    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(got_one.wait(), 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until(lambda: not engine.core.has_requests())
        assert engine.core.scheduler.block_manager.num_free_blocks == 64
        assert len(runner.steps) < 200
    finally:
        engine.shutdown()


async def test_leaving_the_loop_early_aborts_the_request():
    engine, _ = make_engine(step_seconds=0.005)
    try:
        stream = engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=200))
        async for _ in stream:
            break
        await stream.aclose()
        await wait_until(lambda: not engine.core.has_requests())
        assert engine.stats().num_running == 0
    finally:
        engine.shutdown()


async def test_abort_ends_the_stream_with_finish_reason_abort():
    engine, _ = make_engine(step_seconds=0.005)
    try:
        outputs = []
        async for output in engine.generate("r", [1, 2, 3], SamplingParams(max_tokens=200)):
            outputs.append(output)
            if len(outputs) == 2:
                engine.abort("r")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        assert len(outputs) < 100
    finally:
        engine.shutdown()


async def test_many_concurrent_streams():
    engine, _ = make_engine()
    try:
        async def one(i: int) -> int:
            n = 0
            async for output in engine.generate(f"r{i}", [i + 1, i + 2],
                                                SamplingParams(max_tokens=5 + i)):
                n += len(output.outputs[0].token_ids) if output.outputs else 0
            return n
        assert await asyncio.gather(*(one(i) for i in range(8))) == [5 + i for i in range(8)]
    finally:
        engine.shutdown()


async def test_invalid_and_duplicate_requests_are_refused():
    engine, _ = make_engine(step_seconds=0.005)
    try:
        with pytest.raises(InvalidRequest):
            async for _ in engine.generate("bad", [1] * 600, SamplingParams()):
                pass
        stream = engine.generate("dup", [1, 2], SamplingParams(max_tokens=50))
        await stream.__anext__()
        with pytest.raises(InvalidRequest):
            async for _ in engine.generate("dup", [1, 2], SamplingParams()):
                pass
        await stream.aclose()
    finally:
        engine.shutdown()


async def test_a_failing_step_fails_every_open_stream():
    engine, runner = make_engine()

    def explode(out) -> None:
        # Mid-flight: by the 10th step every request has started, none can have finished (200
        # tokens each). (Waiting for a consumer to see an output raced: the collector may fold
        # all 200 tokens into one output before the loop delivers any.)
        if len(runner.steps) >= 10:
            raise RuntimeError("CUDA error: device-side assert")

    runner.hook = explode

    async def consume(i: int):
        async for _ in engine.generate(f"r{i}", [1, 2, i + 3], SamplingParams(max_tokens=200)):
            pass

    results = await asyncio.wait_for(
        asyncio.gather(*(consume(i) for i in range(3)), return_exceptions=True), 5)
    assert all(isinstance(r, Unavailable) for r in results), results
    assert "device-side assert" in str(results[0])
    assert not engine.is_running
    with pytest.raises(Unavailable):
        engine.add_request("late", [1], SamplingParams())
    engine.shutdown()


async def test_shutdown_fails_open_streams():
    engine, _ = make_engine(step_seconds=0.01)

    async def consume():
        async for _ in engine.generate("r", [1, 2], SamplingParams(max_tokens=200)):
            pass

    task = asyncio.create_task(consume())
    await wait_until(lambda: engine.stats().num_running == 1)
    await asyncio.to_thread(engine.shutdown)
    with pytest.raises(Unavailable):
        await asyncio.wait_for(task, 5)


async def test_a_slow_reader_gets_merged_deltas_that_add_up_to_the_same_result():
    """While the reader is busy the engine goes on stepping; what it missed arrives folded into
    fewer messages (never lost, never reordered), with the logprobs of every token."""
    params = SamplingParams(n=2, seed=5, max_tokens=12, logprobs=1)
    (fast_engine, fast_runner), (slow_engine, slow_runner) = make_engine(0.005), make_engine(0.005)
    fast_runner.with_logprobs = slow_runner.with_logprobs = True
    try:
        fast = [o async for o in fast_engine.generate("r", [1, 2, 3], params)]
        slow = []
        async for out in slow_engine.generate("r", [1, 2, 3], params):
            slow.append(out)
            time.sleep(0.03)  # block the loop: several steps finish meanwhile
        assert len(slow) < len(fast)
        for outputs in (fast, slow):
            assert outputs[-1].finished and sum(o.finished for o in outputs) == 1
        for index in (0, 1):
            def joined(outputs, index=index):
                children = [c for o in outputs for c in o.outputs if c.index == index]
                assert [c.finish_reason for c in children][-1] == "length"
                assert all(c.finish_reason is None for c in children[:-1])
                return (sum((c.token_ids for c in children), []), "".join(c.text for c in children),
                        [lp.token_id for c in children for lp in c.logprobs])
            tokens, text, logprob_ids = joined(slow)
            assert (tokens, text, logprob_ids) == joined(fast)
            assert len(tokens) == 12 and logprob_ids == tokens
    finally:
        fast_engine.shutdown()
        slow_engine.shutdown()


async def test_a_config_engine_loads_its_model_on_the_stepping_thread(tmp_path, monkeypatch):
    """torch stepped 1.5-1.8x slower on a thread other than the one that loaded the model (2 CPU
    cores): the engine thread builds the core itself, and a load error reaches the caller."""
    from tests.tiny_models import save_tiny_model
    from shoal.services.engine.runner import model_runner as model_runner_module

    loaded_on: list[str] = []
    real_runner = model_runner_module.ModelRunner

    def recording_runner(*args, **kwargs):
        loaded_on.append(threading.current_thread().name)
        return real_runner(*args, **kwargs)

    monkeypatch.setattr(model_runner_module, "ModelRunner", recording_runner)
    folder = save_tiny_model("llama", tmp_path / "llama")
    engine = AsyncEngine(EngineConfig(model=str(folder), num_kv_blocks=32, block_size=4))
    try:
        out = [o async for o in engine.generate("r", [5, 6, 7], SamplingParams(max_tokens=3))]
        assert out[-1].finished and out[-1].num_generated_tokens >= 1
        assert loaded_on == ["shoal-engine"] and engine.is_running
    finally:
        engine.shutdown()
    with pytest.raises(Exception) as failed:
        AsyncEngine(EngineConfig(model=str(tmp_path / "missing")))
    assert "missing" in str(failed.value)
