"""The serving benchmark's pure parts: a seeded workload, arrivals, and vLLM-named statistics."""

from __future__ import annotations

import math

from loadtests.serving import Result, arrival_gaps, summarize, synthetic_sharegpt


def test_workload_is_seeded_and_bounded() -> None:
    a = synthetic_sharegpt(50, seed=1, max_input=64, max_output=32, shared_prefix=5)
    assert a == synthetic_sharegpt(50, seed=1, max_input=64, max_output=32, shared_prefix=5)
    assert a != synthetic_sharegpt(50, seed=2, max_input=64, max_output=32, shared_prefix=5)
    assert all(9 <= s.input_len <= 69 and 4 <= s.output_len <= 32 for s in a)
    assert len({s.prompt.split()[:5].__repr__() for s in a}) == 1  # the shared prefix
    assert len({s.output_len for s in a}) > 5


def test_arrivals() -> None:
    assert arrival_gaps(3, math.inf, "poisson", 0) == [0.0, 0.0, 0.0]
    assert arrival_gaps(4, 2.0, "fixed", 0) == [0.5] * 4
    gaps = arrival_gaps(4000, 10.0, "poisson", 0)
    assert abs(sum(gaps) / len(gaps) - 0.1) < 0.01


def test_summary_uses_vllm_names() -> None:
    results = [Result(ok=True, ttft=0.1, e2e=1.1, itl=[0.1] * 10, prompt_tokens=5,
                      output_tokens=11),
               Result(ok=True, ttft=0.3, e2e=2.3, itl=[0.2] * 10, prompt_tokens=5,
                      output_tokens=11),
               Result(ok=False, error="HTTP 429")]
    report = summarize(results, duration=2.0)
    assert report["completed"] == 2 and report["failed"] == 1
    assert report["output_throughput"] == 11.0 and report["request_throughput"] == 1.0
    assert math.isclose(report["mean_ttft_ms"], 200.0) and math.isclose(report["median_tpot_ms"],
                                                                        150.0)
    assert {"p99_itl_ms", "median_e2el_ms", "total_token_throughput"} <= set(report)
