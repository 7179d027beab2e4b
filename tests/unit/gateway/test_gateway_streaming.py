"""SSE framing and the OpenAI bodies built from engine deltas (chat and completions, logprobs,
usage with cached tokens), plus admission control."""

from __future__ import annotations

import json

import pytest

from shoal.services.gateway.auth.admission import Admission
from shoal.services.gateway.openai.builders import ChatResponseBuilder, CompletionResponseBuilder
from shoal.services.gateway.openai.responses import add_usage, usage_info
from shoal.services.gateway.openai.streaming import DONE, parse_sse, sse_error, sse_event
from shoal.shared.errors import InvalidRequest, Overloaded, Unavailable
from shoal.shared.schemas.infer import ChoiceDelta, TokenLogprobWire, TopLogprob, Usage


def test_sse_events_are_single_data_lines_and_done_closes() -> None:
    raw = sse_event({"text": "line1\nline2 é"}) + sse_error(Unavailable("engine died")) + DONE
    assert raw.count(b"\n\n") == 3
    assert all(line.startswith(b"data: ") for line in raw.split(b"\n\n") if line)
    events = parse_sse(raw)
    assert json.loads(events[0]) == {"text": "line1\nline2 é"}
    error = json.loads(events[1])["error"]
    assert error["type"] == "service_unavailable" and error["status"] == 503
    assert error["message"] == "engine died"
    assert events[2] == "[DONE]"


def lp(token: str, value: float) -> TokenLogprobWire:
    return TokenLogprobWire(token_id=1, token=token, logprob=value,
                            top=[TopLogprob(token_id=1, token=token, logprob=value),
                                 TopLogprob(token_id=2, token="x", logprob=value - 1)])


def test_chat_chunks_and_final_answer() -> None:
    b = ChatResponseBuilder("m", want_logprobs=True)
    assert b.id.startswith("chatcmpl-")
    entry = b.apply(ChoiceDelta(index=0, text="Par", token_ids=[1], logprobs=[lp("Par", -0.1)]),
                    0)
    e1 = entry.body()
    assert e1["delta"] == {"content": "Par"}
    assert e1["logprobs"]["content"][0]["bytes"] == list(b"Par")
    # the role rides with the choice's first token (as vLLM sends it), once
    assert b.with_role(entry).body()["delta"] == {"role": "assistant", "content": "Par"}
    second = b.apply(ChoiceDelta(index=0, text="is", token_ids=[2], logprobs=[lp("is", -0.2)],
                                 finish_reason="stop"), 0)
    assert b.with_role(second).body()["delta"] == {"content": "is"}
    assert len(e1["logprobs"]["content"][0]["top_logprobs"]) == 2
    assert b.finish(0, "stop") is None  # the delta already closed it
    chunk = b.chunk([entry], with_usage=True).body()
    assert chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None
    assert "usage" not in b.chunk([entry]).body()  # only with stream_options.include_usage
    b.usage = add_usage(None, Usage(prompt_tokens=10, completion_tokens=2, cached_tokens=8))
    final = b.final().body()
    assert final["object"] == "chat.completion"
    assert final["choices"][0]["message"] == {"role": "assistant", "content": "Paris"}
    assert final["choices"][0]["finish_reason"] == "stop"
    assert len(final["choices"][0]["logprobs"]["content"]) == 2
    assert final["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12,
                              "prompt_tokens_details": {"cached_tokens": 8}}


def test_completion_logprobs_offsets_echo_and_finish_from_end() -> None:
    b = CompletionResponseBuilder("m", want_logprobs=True)
    e = b.apply(ChoiceDelta(index=1, text="ab", token_ids=[1, 2],
                            logprobs=[lp("a", -1.0), lp("b", -2.0)]), 3).body()
    assert e["index"] == 3 and e["logprobs"]["text_offset"] == [0, 1]
    assert e["logprobs"]["tokens"] == ["a", "b"]
    e = b.apply(ChoiceDelta(index=1, text="c", token_ids=[3], logprobs=[lp("c", -0.5)]),
                3).body()
    assert e["logprobs"]["text_offset"] == [2]
    closing = b.finish(3, "length")
    assert closing is not None and closing.finish_reason == "length"
    final = b.final({3: "echo:"}).body()
    assert final["object"] == "text_completion" and final["choices"][0]["text"] == "echo:abc"
    assert final["choices"][0]["logprobs"]["token_logprobs"] == [-1.0, -2.0, -0.5]
    assert final["choices"][0]["logprobs"]["top_logprobs"][0] == {"a": -1.0, "x": -2.0}


def test_usage_adds_up_over_batched_prompts() -> None:
    total = add_usage(Usage(prompt_tokens=3, completion_tokens=4, cached_tokens=1),
                      Usage(prompt_tokens=5, completion_tokens=6, cached_tokens=2))
    body = usage_info(total).body()
    assert body["total_tokens"] == 18 and body["prompt_tokens_details"] == {"cached_tokens": 3}


def test_admission_is_bounded_and_releases() -> None:
    gate = Admission(2)
    with gate.slot(), gate.slot():
        with pytest.raises(Overloaded) as err:
            with gate.slot():
                pass
        assert err.value.http_status == 429
    assert gate.num_active == 0
    with pytest.raises(RuntimeError):
        with gate.slot():
            raise RuntimeError("handler failed")
    assert gate.num_active == 0


def test_admission_counts_what_a_request_costs() -> None:
    """A batched completion of N prompts holds N (times n) sequences, not one slot."""
    gate = Admission(10)
    with gate.slot(8, param="prompt"):
        assert gate.num_active == 8 and gate.num_requests == 1
        with pytest.raises(Overloaded):
            with gate.slot(3, param="prompt"):
                pass
        with gate.slot(2, param="n"):
            assert gate.num_active == 10
    assert gate.num_active == 0 and gate.num_requests == 0
    with pytest.raises(InvalidRequest) as err:  # could never fit: not a 429 to retry forever
        with gate.slot(500, param="prompt"):
            pass
    assert err.value.param == "prompt" and gate.num_active == 0
