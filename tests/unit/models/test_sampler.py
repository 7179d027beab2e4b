"""sampler.py: greedy, penalties (checked against transformers' processors), min_tokens,
top-k / top-p / min-p supports, the sampled distribution, seeded draws independent of the batch,
and logprobs from the raw logits."""

from __future__ import annotations

import pytest
import torch
from tests.seeding import fresh_generator
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

from shoal.services.engine.runner.sampler import SeqState, greedy_tokens, mix_seed, sample
from shoal.services.engine.sampling_params import SamplingParams
from shoal.shared.errors import InvalidRequest

VOCAB = 50
EOS = frozenset({2})


def _state(tokens: list[int] | None = None, prompt_len: int = 0, seed: int | None = None,
           **params: object) -> SeqState:
    p = SamplingParams(seed=seed, **params)  # type: ignore[arg-type]
    gen = None
    if not p.is_greedy:
        gen = torch.Generator().manual_seed(mix_seed(seed if seed is not None else 1234, 0))
    return SeqState(params=p, token_ids=list(tokens or []), prompt_len=prompt_len, generator=gen)


def _logits(rows: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=fresh_generator()) * 3


def test_greedy_is_argmax() -> None:
    logits = _logits(5)
    tokens, lps = sample(logits.clone(), [_state(temperature=0.0) for _ in range(5)], EOS)
    assert tokens == logits.argmax(-1).tolist() and lps == [None] * 5


def test_repetition_penalty_matches_transformers() -> None:
    logits = _logits(1)
    seen = [3, 7, 7, 11, 40]
    state = _state(seen, prompt_len=2, temperature=0.0, repetition_penalty=1.7)
    expected = RepetitionPenaltyLogitsProcessor(1.7)(torch.tensor([seen]), logits.clone())
    row = logits.clone()
    sample(row, [state], EOS)
    assert torch.equal(row, expected)


def test_presence_and_frequency_penalties_count_output_only() -> None:
    logits = _logits(1)
    state = _state([5, 5, 9, 9, 9, 4], prompt_len=3, temperature=0.0, presence_penalty=0.5,
                   frequency_penalty=0.25)
    row = logits.clone()
    sample(row, [state], EOS)
    expected = logits.clone()
    expected[0, 9] -= 0.5 + 0.25 * 2  # output tokens: 9, 9, 4 (the prompt's 5s do not count)
    expected[0, 4] -= 0.5 + 0.25
    torch.testing.assert_close(row, expected)


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, 2] = 10.0  # EOS is the favourite
    logits[:, 8] = 9.0  # then a stop token id
    early = _state([1, 1, 1], prompt_len=2, temperature=0.0, min_tokens=3, stop_token_ids=[8])
    done = _state([1, 1, 1, 1, 1], prompt_len=2, temperature=0.0, min_tokens=3, stop_token_ids=[8])
    tokens, _ = sample(logits.clone(), [early, done], EOS)
    assert tokens[0] not in (2, 8) and tokens[1] == 2


@pytest.mark.parametrize("kwargs", [dict(top_k=3), dict(top_p=0.3), dict(min_p=0.2),
                                    dict(top_k=5, top_p=0.5)])
def test_truncation_keeps_draws_inside_the_allowed_set(kwargs: dict) -> None:
    logits = _logits(1)[0]
    probs = logits.softmax(-1)
    order = probs.argsort(descending=True)
    top = order[: kwargs.get("top_k", VOCAB)]
    allowed = set(top.tolist())
    if "top_p" in kwargs:  # the nucleus of what top-k kept, renormalised (vLLM's order)
        cum = (probs[top] / probs[top].sum()).cumsum(0)
        allowed &= set(top[: int((cum < kwargs["top_p"]).sum()) + 1].tolist())
    if "min_p" in kwargs:
        allowed &= set(torch.nonzero(probs >= kwargs["min_p"] * probs.max()).flatten().tolist())
    state = _state(seed=3, temperature=1.0, **kwargs)
    seen = {sample(logits[None].clone(), [state], EOS)[0][0] for _ in range(200)}
    assert seen <= allowed and len(seen) > 1 or len(allowed) == 1


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.full((1, VOCAB), -1e9)
    logits[0, :3] = torch.tensor([2.0, 1.0, 0.0])
    state = _state(seed=11, temperature=0.5)
    counts = torch.zeros(3)
    for _ in range(2000):
        counts[sample(logits.clone(), [state], EOS)[0][0]] += 1
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / 0.5, 0) * 2000
    assert ((counts - expected).abs() < 4 * expected.sqrt() + 5).all(), (counts, expected)


def test_seeded_draws_do_not_depend_on_the_batch() -> None:
    logits = _logits(4)
    alone = _state(seed=42, temperature=0.9, top_p=0.9)
    solo = [sample(logits[:1].clone(), [alone], EOS)[0][0] for _ in range(20)]
    mates = [_state(seed=None, temperature=1.3), _state(temperature=0.0), _state(seed=7, top_k=4)]
    batched_state = _state(seed=42, temperature=0.9, top_p=0.9)
    batched = []
    for _ in range(20):
        order = torch.randperm(3).tolist()
        states = [batched_state] + [mates[i] for i in order]
        rows = torch.cat([logits[:1], logits[1:][order]])
        batched.append(sample(rows.clone(), states, EOS)[0][0])
    assert batched == solo


def test_logprobs_come_from_the_raw_logits() -> None:
    logits = _logits(2)
    states = [_state([1, 2, 3], prompt_len=1, temperature=0.0, logprobs=4, repetition_penalty=2.0),
              _state(temperature=0.0, logprobs=0)]
    tokens, lps = sample(logits.clone(), states, EOS)
    raw = torch.log_softmax(logits, -1)
    for i, entry in enumerate(lps):
        assert entry is not None and entry.token_id == tokens[i]
        assert abs(entry.logprob - float(raw[i, tokens[i]])) < 1e-6
        assert entry.rank == int((raw[i] > raw[i, tokens[i]]).sum()) + 1
        n = states[i].params.logprobs
        top_ids = [t for t, _ in entry.top]
        assert top_ids == raw[i].topk(n).indices.tolist() if n else entry.top == []


def test_logit_bias_is_added_before_sampling_greedy_and_random() -> None:
    logits = _logits(3)
    low = int(logits[0].argmin())
    bias = {low: 100.0, int(logits[0].argmax()): -100.0}
    rows = logits.clone()
    states = [_state(temperature=0.0, logit_bias=bias), _state(temperature=0.0),
              _state(seed=5, temperature=1.0, logit_bias={low: 100.0})]
    tokens, _ = sample(rows, states, EOS)
    expected = logits[0].clone()
    expected[list(bias)] += torch.tensor(list(bias.values()))
    torch.testing.assert_close(rows[0], expected)  # exactly the bias, on exactly these ids
    assert tokens[0] == low and tokens[1] == int(logits[1].argmax())  # the other row untouched
    assert tokens[2] == low  # +100 outweighs any logit of these rows (|x| < 20)


def test_logit_bias_keeps_logprobs_raw_and_masks_masked() -> None:
    logits = _logits(1)
    logits[0, 4] = float("-inf")  # masked (a grammar would), whatever its bias
    state = _state(temperature=0.0, logit_bias={4: 100.0, 9: 100.0}, logprobs=0)
    raw = torch.log_softmax(logits[0], dim=-1)
    tokens, lps = sample(logits.clone(), [state], EOS)
    assert tokens == [9] and lps[0] is not None
    assert lps[0].logprob == pytest.approx(float(raw[9]))


def test_logit_bias_from_the_wire_and_its_checks() -> None:
    assert SamplingParams(logit_bias={"12": -5, 3: 1.5}).logit_bias == {12: -5.0, 3: 1.5}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bad in ({"x": 1}, {"-1": 1}, {-2: 1}, {1: 101}, {1: "a"}, {1: float("nan")}, {True: 1}):
        with pytest.raises(InvalidRequest) as err:
            SamplingParams(logit_bias=bad)  # type: ignore[arg-type]
        assert err.value.param == "logit_bias"


def test_greedy_tokens_is_argmax_with_the_first_index_on_ties() -> None:
    logits = torch.randn(64, 49152)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first one wins
    logits[5, :] = 0.0  # all equal: index 0
    logits[7, 100] = float("inf")
    assert torch.equal(greedy_tokens(logits), logits.argmax(dim=-1))
    assert greedy_tokens(logits)[[3, 5, 7]].tolist() == [10, 0, 100]
