"""The failover's pure half (routing/failover.py): which streams may move, the request that
continues one, and what the client sees across the move."""

from __future__ import annotations

from shoal.services.gateway.routing.failover import Failover
from shoal.shared.schemas.infer import (
    ChoiceDelta, GenerateRequest, InferChunk, InferEnd, SamplingOptions, StructuredOutputsOptions,
    Usage
)


def request(**sampling: object) -> GenerateRequest:
    return GenerateRequest(request_id="r", model="m", prompt="hi",
                           sampling=SamplingOptions(**sampling))


def test_only_reproducible_single_streams_move() -> None:
    assert Failover(request(temperature=0)).refusal() is None
    assert Failover(request(temperature=0.8, seed=3)).refusal() is None
    assert Failover(request(temperature=0.8)).refusal() == "not_reproducible"
    assert Failover(request(temperature=0, n=2)).refusal() == "n_above_1"
    assert Failover(request(temperature=0, structured_outputs=StructuredOutputsOptions(
        choice=["a", "b"]))).refusal() == "structured_output"


def test_the_continuation_carries_what_was_delivered_and_usage_stays_the_requests() -> None:
    f = Failover(request(temperature=0, max_tokens=10, prompt_logprobs=1))
    first = InferChunk(request_id="r", seq=0, choices=[], prompt_token_ids=[1, 2, 3])
    assert f.seen(first) is first
    for seq, (ids, text) in enumerate([([7], "Hel"), ([8, 9], "lo")], start=1):
        f.seen(InferChunk(request_id="r", seq=seq,
                          choices=[ChoiceDelta(index=0, text=text, token_ids=ids)]))
    moved = f.resumed()
    assert moved.resume is not None and moved.resume.token_ids == [7, 8, 9]
    assert moved.resume.text == "Hello" and moved.sampling.prompt_logprobs is None
    assert moved.sampling.max_tokens == 10  # the engine counts the resumed tokens against it
    # the new engine's acceptance is not passed on; its end's usage is the whole request's
    assert f.seen(InferChunk(request_id="r", seq=0, choices=[], prompt_token_ids=[1, 2, 3])) is None
    f.seen(InferChunk(request_id="r", seq=1, choices=[ChoiceDelta(index=0, text="!",
                                                                  token_ids=[4])]))
    end = f.seen(InferEnd(request_id="r", seq=2, instance_id="b", usage=Usage(prompt_tokens=3,
                                                             completion_tokens=1)))
    assert isinstance(end, InferEnd) and end.usage == Usage(prompt_tokens=3, completion_tokens=4)
