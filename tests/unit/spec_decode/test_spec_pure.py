"""Speculative decoding's pure parts: the n-gram lookup, the config's rules, and the rejection
sampler's exactness (a statistical test on a toy vocabulary that a wrong rule fails)."""

from __future__ import annotations

import pytest
import torch

from shoal.services.engine import ConfigError, EngineConfig
from shoal.services.engine.core.outputs import RunnerOutput
from shoal.services.engine.spec_decode.ngram import NgramProposer
from shoal.services.engine.spec_decode.rejection import greedy_accept, rejection_sample
from shoal.services.engine.core.spec_decode_stats import SpecDecodeStats
from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.speculative import parse_speculative_config


def test_ngram_proposes_what_followed_the_latest_longest_match() -> None:
    ngram = NgramProposer(1, 3)
    #           0  1  2  3  4  5  6  7  8  9 10 11
    tokens = [1, 2, 3, 9, 7, 2, 3, 4, 5, 6, 2, 3]
    # suffix [2, 3]: occurs at 1..2 (then 9) and 5..6 (then 4): the latest wins
    assert ngram.propose(tokens, 3) == [4, 5, 6]
    # a longer match beats a later shorter one: [7, 2, 3] only at 4..6
    assert ngram.propose([7, 2, 3, 8, 8, 2, 3, 1, 7, 2, 3], 2) == [8, 8]
    assert ngram.propose(tokens, 0) == [] and ngram.propose([1, 2, 3], 4) == []
    assert NgramProposer(3, 3).propose(tokens, 3) == []  # only 2-grams match
    assert ngram.propose([5, 5, 5], 4) == [5]  # what follows runs into the suffix itself


def test_speculative_config_follows_vllms_rules() -> None:
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (5, 5)
    spec = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, '
                                    '"prompt_lookup_max": 4}')
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (4, 4)
    assert parse_speculative_config({"model": "/d", "num_speculative_tokens": 2}).method == \
        "draft_model"
    for bad in ({"method": "ngram"}, {"method": "ngram", "num_speculative_tokens": 0},
                {"method": "eagle", "num_speculative_tokens": 2},
                {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                 "prompt_lookup_max": 2},
                {"method": "layer_skip", "num_speculative_tokens": 2},
                {"num_speculative_tokens": 2}, "not json", ["a"]):
        with pytest.raises(InvalidRequest) as err:
            parse_speculative_config(bad)
        assert err.value.param == "speculative_config"
    with pytest.raises(ConfigError) as cfg_err:
        EngineConfig(model="m", speculative_config={"method": "ngram"})
    assert cfg_err.value.param == "speculative_config"


def test_greedy_accepts_the_leading_matches() -> None:
    assert greedy_accept([4, 5, 6, 7], [4, 5, 9]) == 2
    assert greedy_accept([4, 5, 6, 7], [4, 5, 6]) == 3
    assert greedy_accept([1, 2], [3]) == 0


def test_stats_count_per_position() -> None:
    stats = SpecDecodeStats(3)
    stats.observe(3, 2)
    stats.observe(2, 0)
    stats.observe(0, 0)  # no drafts: not a draft
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 5, 2)
    assert stats.accepted_per_pos == [1, 1, 0] and stats.acceptance_rate == 0.4


VOCAB, K, TRIALS = 6, 3, 60_000
CHI2_LIMIT = 30.0
"""chi-square with 5 degrees of freedom exceeds 30 with probability ~1.5e-5."""


def _chi2(samples: torch.Tensor, p: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=VOCAB).double()
    expected = p.double() * samples.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def _emitted(num_accepted: torch.Tensor, token: torch.Tensor, draft: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first emitted token, second emitted token, whether the first was draft 0)."""
    first = torch.where(num_accepted >= 1, draft[:, 0], token)
    second = torch.where(num_accepted >= 2, draft[:, 1], token)
    return first, second, num_accepted >= 1


def test_rejection_sampling_keeps_the_target_distribution() -> None:
    """Point-mass drafts (d0, d1, d2) against fixed target distributions p0..p3: the first
    emitted token must follow p0, and the second, given the first was d0, must follow p1 (the
    target conditioned on the accepted prefix). A sampler that redraws from p instead of the
    residual (p without the rejected draft) fails the same test, so the test has teeth."""
    gen = torch.Generator().manual_seed(7)
    with torch.random.fork_rng():  # fixed targets whatever ran before (Dirichlet takes no
        torch.manual_seed(7)       # generator): a tiny p0[d0] would blunt the teeth below
        probs = torch.distributions.Dirichlet(torch.ones(VOCAB)).sample((K + 1,))  # [K+1, V]
    probs = probs / probs.sum(dim=-1, keepdim=True)
    draft_row = torch.tensor([2, 4, 1])
    b = TRIALS
    batch = probs[None].expand(b, -1, -1)
    draft = draft_row[None].expand(b, -1)
    uniform = torch.rand(b, K, generator=gen)
    race = torch.empty(b, VOCAB).exponential_(generator=gen)
    n, token = rejection_sample(batch, draft, torch.full((b,), K), uniform, race)
    first, second, first_was_draft = _emitted(n, token, draft)
    assert _chi2(first, probs[0]) < CHI2_LIMIT
    assert _chi2(second[first_was_draft], probs[1]) < CHI2_LIMIT
    assert abs(float((n >= 1).double().mean()) - float(probs[0, 2])) < 0.01  # accept rate p(d)

    # A wrong rule: on rejection redraw from p itself (the draft can come back).
    wrong = torch.where(n < K, (batch[torch.arange(b), n.clamp(max=K)] / race).argmax(dim=1),
                        token)
    wrong_first, _, _ = _emitted(n, wrong, draft)
    assert _chi2(wrong_first, probs[0]) > 10 * CHI2_LIMIT


def test_fewer_drafts_than_slots_and_bonus_tokens() -> None:
    """A row with 1 draft (of 3 slots) that is certain: accepted, then the bonus comes from the
    next row; a certain rejection draws from the residual."""
    probs = torch.zeros(2, K + 1, VOCAB)
    probs[:, :, 3] = 1.0
    draft = torch.tensor([[3, 0, 0], [5, 0, 0]])
    n, token = rejection_sample(probs, draft, torch.tensor([1, 1]), torch.full((2, K), 0.5),
                                torch.ones(2, VOCAB))
    assert n.tolist() == [1, 0] and token.tolist() == [3, 3]


def test_metrics_carry_vllms_names() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from shoal.services.engine.server.metrics import SpecDecodeCollector

    stats = SpecDecodeStats(2)
    stats.observe(2, 1)
    registry = CollectorRegistry()
    registry.register(SpecDecodeCollector(lambda: stats, {"model_name": "m", "engine": "e"}))
    text = generate_latest(registry).decode()
    assert 'vllm:spec_decode_num_drafts_total{engine="e",model_name="m"} 1.0' in text
    assert 'vllm:spec_decode_num_draft_tokens_total{engine="e",model_name="m"} 2.0' in text
    assert 'vllm:spec_decode_num_accepted_tokens_total{engine="e",model_name="m"} 1.0' in text
    assert ('vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="e",model_name="m",'
            'position="1"} 0.0') in text
    off = CollectorRegistry()
    off.register(SpecDecodeCollector(lambda: None, {"model_name": "m", "engine": "e"}))
    assert "spec_decode" not in generate_latest(off).decode()


def test_verify_samples_the_processed_distribution() -> None:
    """The runner's glue (verify.py): with temperature and top-p, the first emitted token follows
    the distribution an ordinary step draws from (processed_probs), whatever the draft."""
    from shoal.services.engine.runner.sampler import SeqState, processed_probs
    from shoal.services.engine.sampling_params import SamplingParams
    from shoal.services.engine.spec_decode.verify import verify

    params = SamplingParams(temperature=0.7, top_p=0.9)
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0, 1.5, 0.0],
                           [0.0, 0.3, 2.0, 1.0, -0.5, 0.2]])
    target = processed_probs(logits[:1].clone(), [params])[0]
    target = target / target.sum()
    state = SeqState(params=params, token_ids=[1, 2, 3], prompt_len=3,
                     generator=torch.Generator().manual_seed(3))
    firsts = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: OpenMP's barriers cost more than the work
    try:
        for _ in range(4000):
            accepted, token = verify(logits.clone(), state, [1], frozenset())
            firsts.append(accepted[0] if accepted else token)
            assert accepted in ([], [1])
    finally:
        torch.set_num_threads(threads)
    assert float(target[3]) == 0.0 and 3 not in firsts  # cut by top-p, never emitted
    kept = target > 0
    counts = torch.bincount(torch.tensor(firsts), minlength=VOCAB).double()[kept]
    expected = target[kept].double() * len(firsts)
    assert float(((counts - expected) ** 2 / expected).sum()) < CHI2_LIMIT


def test_scheduler_reserves_draft_slots_only_where_speculation_applies() -> None:
    """Plain decodes get k slots (within max_tokens and the step budget); structured outputs and
    logprobs get none; nothing at or above disable_by_batch_size running sequences."""
    from shoal.services.engine.sampling_params import SamplingParams, StructuredOutputsParams
    from shoal.services.engine.core.scheduler import Scheduler
    from shoal.services.engine.core.sequence import Sequence

    def step_spec(params: list[SamplingParams], disable: int | None = None) -> list[int]:
        config = EngineConfig(model="m", block_size=4, speculative_config={
            "method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": disable})
        sched = Scheduler(config, num_kv_blocks=64, max_model_len=128)
        sched.add([Sequence(i, str(i), [5, 6, 7], 3, p) for i, p in enumerate(params)])
        out = sched.schedule()  # prefill
        sched.update(out, RunnerOutput({s.seq_id: 9 for s in out.scheduled}))
        return [s.num_spec_tokens for s in sched.schedule().scheduled]

    plain = SamplingParams(max_tokens=10)
    guided = SamplingParams(max_tokens=10, structured_outputs=StructuredOutputsParams(
        choice=["a", "b"]))
    assert step_spec([plain, guided, SamplingParams(max_tokens=10, logprobs=1),
                      SamplingParams(max_tokens=3)]) == [3, 0, 0, 1]
    assert step_spec([plain, plain], disable=2) == [0, 0]
    assert step_spec([plain], disable=2) == [3]


def test_verify_greedy_applies_logit_bias() -> None:
    """A biased greedy sequence verifies its drafts against the biased argmax, as an ordinary
    step would pick it."""
    from shoal.services.engine.runner.sampler import SeqState
    from shoal.services.engine.sampling_params import SamplingParams
    from shoal.services.engine.spec_decode.verify import verify

    logits = torch.tensor([[5.0, 0.0, 0.0], [5.0, 0.0, 0.0]])
    state = SeqState(params=SamplingParams(temperature=0.0, logit_bias={2: 10.0}),
                     token_ids=[0], prompt_len=1)
    assert verify(logits.clone(), state, [2], frozenset()) == ([2], 2)
    plain = SeqState(params=SamplingParams(temperature=0.0), token_ids=[0], prompt_len=1)
    assert verify(logits.clone(), plain, [2], frozenset()) == ([], 0)
