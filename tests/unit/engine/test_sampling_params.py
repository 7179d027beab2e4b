"""SamplingParams: every invalid value is refused with InvalidRequest naming the parameter."""

from __future__ import annotations

import pytest

from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest

INVALID = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", 129),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01), ("top_p", -1.0),
    ("top_k", -2), ("top_k", 1.5),
    ("min_p", -0.01), ("min_p", 1.5),
    ("presence_penalty", 2.5), ("presence_penalty", -2.1),
    ("frequency_penalty", 3.0), ("frequency_penalty", float("nan")),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0),
    ("repetition_penalty", float("inf")), ("temperature", float("inf")),
    ("repetition_penalty", float("nan")),
    ("seed", 1.5), ("seed", "x"),
    ("stop", [""]), ("stop", [1]), ("stop", [f"s{i}" for i in range(17)]),
    ("stop_token_ids", [-1]), ("stop_token_ids", ["a"]),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 2.0),
    ("min_tokens", -1), ("min_tokens", 1.5),
    ("logprobs", -1), ("logprobs", 21), ("logprobs", 1.0),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21),
]


@pytest.mark.parametrize("param,value", INVALID)
def test_invalid_values_are_refused_naming_the_param(param, value):
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(**{param: value})
    assert err.value.param == param
    assert param in err.value.message
    assert err.value.http_status == 400


def test_min_tokens_above_max_tokens_is_refused():
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert err.value.param == "min_tokens"
    assert SamplingParams(max_tokens=None, min_tokens=50).min_tokens == 50


def test_valid_edges_are_accepted_and_normalised():
    params = SamplingParams(n=128, temperature=0, top_p=1.0, top_k=-1, min_p=1.0,
                            presence_penalty=-2, frequency_penalty=2, seed=0, stop="###",
                            stop_token_ids=(1, 2), max_tokens=None, logprobs=20, prompt_logprobs=0)
    assert params.top_k == 0 and params.stop == ["###"] and params.stop_token_ids == [1, 2]
    assert params.is_greedy and not SamplingParams().is_greedy
