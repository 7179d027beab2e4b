"""How a backend's adapter speaks to the backend (services/backends/proxy.py): a request's
sampling options in vLLM's /v1/completions fields, the backend's refusals as our error kinds,
and vLLM's token ids in logprobs."""

from __future__ import annotations

from shoal.services.backends.proxy import completion_body, error_from_body, token_id_of
from shoal.shared.errors import InvalidRequest, NotFound, Unavailable
from shoal.shared.schemas.infer import GenerateRequest, SamplingOptions, StructuredOutputsOptions


def test_completion_body_names_what_is_set_in_vllms_words() -> None:
    req = GenerateRequest(request_id="r", model="m", prompt="hi", sampling=SamplingOptions(
        n=2, temperature=0.5, top_k=5, max_tokens=7, stop=["\n"], seed=3, logprobs=2,
        ignore_eos=True, logit_bias={11: -5.0},
        structured_outputs=StructuredOutputsOptions(choice=["a", "b"])))
    body = completion_body(req, "served", [1, 2, 3])
    assert body["model"] == "served" and body["prompt"] == [1, 2, 3]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["return_token_ids"] is True  # deltas carry their token ids
    assert (body["n"], body["temperature"], body["top_k"], body["max_tokens"]) == (2, 0.5, 5, 7)
    assert body["stop"] == ["\n"] and body["seed"] == 3 and body["ignore_eos"] is True
    assert body["logprobs"] == 2 and body["return_tokens_as_token_ids"] is True
    assert body["logit_bias"] == {"11": -5.0}
    assert body["structured_outputs"] == {"choice": ["a", "b"], "disable_any_whitespace": False}
    plain = completion_body(GenerateRequest(request_id="r", model="m", prompt="hi"), "s", [1])
    assert not {"top_k", "min_p", "seed", "stop", "logprobs", "repetition_penalty",
                "structured_outputs"} & set(plain)


def test_refusals_keep_their_kind_and_words() -> None:
    bad = error_from_body(400, '{"error": {"message": "too long", "param": "prompt"}}')
    assert isinstance(bad, InvalidRequest) and bad.message == "too long"
    assert bad.param == "prompt"
    vllm_shape = error_from_body(404, '{"object": "error", "message": "no such model"}')
    assert isinstance(vllm_shape, NotFound) and vllm_shape.message == "no such model"
    assert isinstance(error_from_body(422, "{}"), InvalidRequest)
    assert isinstance(error_from_body(500, "boom"), Unavailable)


def test_token_ids_from_vllms_token_strings() -> None:
    assert token_id_of("token_id:123") == 123
    assert token_id_of("Paris") == -1


def test_embeddings_go_as_floats_and_come_back_as_our_rows() -> None:
    import base64
    import struct

    import pytest

    from shoal.services.backends.embed import embed_reply, embedding_body, serves_embeddings
    from shoal.shared.schemas.infer import EmbedRequest

    body = embedding_body(EmbedRequest(model="m", token_ids=[[1, 2]], dimensions=2,
                                       truncate_prompt_tokens=-1), "served")
    assert body == {"model": "served", "encoding_format": "float", "input": [[1, 2]],
                    "dimensions": 2, "truncate_prompt_tokens": -1}
    as_b64 = base64.b64encode(struct.pack("<2f", 0.5, -1.0)).decode()
    reply = embed_reply({"data": [{"index": 1, "embedding": as_b64},  # out of order, base64
                                  {"index": 0, "embedding": [0.25, 2]}],
                         "usage": {"prompt_tokens": 7}})
    assert (reply.num_inputs, reply.dimensions, reply.prompt_tokens) == (2, 2, 7)
    assert struct.unpack("<4f", base64.b64decode(reply.data)) == (0.25, 2.0, 0.5, -1.0)
    with pytest.raises(ValueError, match="width"):
        embed_reply({"data": [{"index": 0, "embedding": [1.0]},
                              {"index": 1, "embedding": [1.0, 2.0]}]})
    with pytest.raises(ValueError, match="no embeddings"):
        embed_reply({"object": "error"})
    assert serves_embeddings(["--runner pooling"]) and serves_embeddings(["--task=embed"])
    assert serves_embeddings(["--convert", "embed"]) and not serves_embeddings(["--runner auto"])
