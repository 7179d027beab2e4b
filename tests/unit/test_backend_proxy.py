"""How a backend's adapter speaks to the backend (services/backends/proxy.py): a request's
sampling options in vLLM's /v1/completions fields, the backend's refusals as our error kinds,
and vLLM's token ids in logprobs."""

from __future__ import annotations

import json

import aiohttp

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
    kept = error_from_body(400, '{"error": {"message": "m", "code": "wrong_model_type"}}')
    assert kept.code == "wrong_model_type"  # (another Shoal, or an OpenAI-shaped server)
    assert error_from_body(400, '{"object": "error", "message": "m", "code": 400}').code == (
        "invalid_request")  # vLLM's code is the status: ours stays


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


def test_scores_go_as_vllms_pairs_and_come_back_in_pair_order() -> None:
    import pytest

    from shoal.services.backends.embed import score_body, score_reply
    from shoal.shared.schemas.infer import ScoreRequest

    req = ScoreRequest(model="m", text_1=["q", "q"], text_2=["a", "b"], truncate_prompt_tokens=-1)
    assert score_body(req, "served") == {"model": "served", "text_1": ["q", "q"],
                                         "text_2": ["a", "b"], "truncate_prompt_tokens": -1}
    reply = score_reply({"data": [{"index": 1, "object": "score", "score": 0.25},
                                  {"index": 0, "object": "score", "score": 0.75}],
                         "usage": {"prompt_tokens": 9}}, 2)
    assert (reply.scores, reply.prompt_tokens) == ([0.75, 0.25], 9)
    with pytest.raises(ValueError, match="2 scores"):
        score_reply({"data": [{"index": 0, "score": 1.0}]}, 2)


class Tokenizer:
    """Renders a chat as its template variables, so the test sees what reached the template."""

    def __len__(self) -> int:
        return 100

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return ["t"] * len(ids)

    def apply_chat_template(self, messages: list, **kwargs: object) -> str:
        return f"thinking={kwargs.get('enable_thinking', 'default')}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [1] if text == "thinking=False" else [2]


class Inbox:
    """Where the adapter publishes its replies (the NATS client's publish, recorded)."""

    def __init__(self) -> None:
        self.replies: list[object] = []

    async def publish(self, subject: str, data: bytes) -> None:
        from shoal.shared.bus.codec import decode
        from shoal.shared.schemas.infer import InferReplyEnvelope

        self.replies.append(decode(data, InferReplyEnvelope).reply)


async def test_the_adapter_names_the_reasoning_parser_of_a_chat_in_seq_0() -> None:
    """A vLLM backend's adapter renders the chat (chat_template_kwargs included) and names the
    model's reasoning parser in seq 0 of a chat request only: the gateway splits, not vLLM."""
    from aiohttp import web
    from opentelemetry.trace import INVALID_SPAN

    from shoal.services.backends.proxy import BackendHandlers
    from shoal.services.engine import InputProcessor, Replies
    from shoal.shared.embedded import free_port
    from shoal.shared.schemas.infer import ChatMessage, InferChunk

    prompts = []

    async def completions(request: web.Request) -> web.StreamResponse:  # vLLM's, streamed
        prompts.append((await request.json())["prompt"])
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for event in ({"choices": [{"index": 0, "text": "hm</think>4", "token_ids": [5, 6]}]},
                      {"choices": [{"index": 0, "text": "", "finish_reason": "stop"}],
                       "usage": {"prompt_tokens": 1, "completion_tokens": 2}}):
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
        await response.write(b"data: [DONE]\n\n")
        return response

    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port(None)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    adapter = BackendHandlers(bus=None, instance_id="i", model_name="m",  # type: ignore[arg-type]
                              base_url=f"http://127.0.0.1:{port}", served_name="m",
                              tokenizer=Tokenizer(), max_model_len=64,
                              reasoning_parser="deepseek_r1")
    adapter.inputs = InputProcessor(tokenizer=adapter.tokenizer, max_model_len=64)
    adapter.session = aiohttp.ClientSession()
    try:
        chat = GenerateRequest(request_id="r", model="m",
                               messages=[ChatMessage(role="user", content="2+2?")],
                               chat_template_kwargs={"enable_thinking": False})
        inbox = Inbox()
        await adapter.serve(chat, Replies(inbox, "inbox", "r"), INVALID_SPAN)  # type: ignore[arg-type]
        first = inbox.replies[0]
        assert isinstance(first, InferChunk) and first.reasoning_parser == "deepseek_r1"
        assert prompts == [[1]]  # the template saw enable_thinking=False
        assert [c.text for r in inbox.replies[1:] if isinstance(r, InferChunk)
                for c in r.choices] == ["hm</think>4", ""]  # the text as vLLM wrote it
        plain = Inbox()
        await adapter.serve(GenerateRequest(request_id="p", model="m", prompt="hi"),
                            Replies(plain, "inbox", "p"), INVALID_SPAN)  # type: ignore[arg-type]
        assert plain.replies[0].reasoning_parser is None
    finally:
        await adapter.session.close()
        await runner.cleanup()
