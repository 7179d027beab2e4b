"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions, /tokenize,
/detokenize (/v1/embeddings, /v1/score and /v1/rerank: pooling_routes.py). Thin: parse and
validate (protocol.py), admit, route, answer (serve.py).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from shoal.services.gateway.auth.quota import usage_tag
from shoal.services.gateway.auth.reservation import (
    chat_tokens, prompt_tokens, reservation
)
from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.builders import ChatResponseBuilder, CompletionResponseBuilder
from shoal.services.gateway.openai.objects import (
    DetokenizeResponse, ModelCard, ModelList, TokenizeResponse
)
from shoal.services.gateway.openai.protocol import (
    ChatCompletionRequest, CompletionRequest, DetokenizeBody, TokenizeBody
)
from shoal.services.gateway.openai.serve import Answer, Job
from shoal.services.gateway.openai.structured import rename_param
from shoal.services.gateway.openai.tools import parameter_schemas
from shoal.services.gateway.routing.router import (
    lora_prefix_hashes, messages_prefix_hashes, text_prefix_hashes, token_prefix_hashes
)
from shoal.services.gateway.state import STATE
from shoal.services.gateway.tracing import inference_span
from shoal.shared.errors import InvalidRequest, ShoalError
from shoal.shared.logging import log_context
from shoal.shared.schemas.infer import (
    DetokenizeReply, DetokenizeRequest, TokenizeReply, TokenizeRequest
)

routes = web.RouteTableDef()


@routes.get("/v1/models")
async def list_models(request: web.Request) -> web.Response:
    st = request.app[STATE]
    try:  # each name a model answers to is listed, its aliases too (as vLLM lists them)
        listed = await st.registry.list_models()
        models = [(served, m.name, int(m.created_at.timestamp()), m.max_model_len)
                  for m in listed for served in (m.name, *m.aliases)]
    except ShoalError:  # the registry is away: still list what is being served
        listed = []
        models = [(name, name, int(st.started_at), None) for name in st.table.model_names()]
    data = [_model_card(request, *model) for model in models]
    for m in listed:  # LoRA adapters as vLLM lists them: root = the adapter, parent = the model
        for lora in m.lora_modules:
            card = _model_card(request, lora.name, m.name, int(m.created_at.timestamp()),
                               m.max_model_len)
            data.append(card.model_copy(update={"root": lora.path, "parent": m.name}))
    return web.json_response(ModelList(data=data).body())


@routes.get("/v1/models/{name}")
async def get_model(request: web.Request) -> web.Response:
    st = request.app[STATE]
    name = request.match_info["name"]
    for model in await st.registry.list_models():
        if name == model.name or name in model.aliases:
            return web.json_response(_model_card(
                request, name, model.name, int(model.created_at.timestamp()),
                model.max_model_len).body())
        for lora in model.lora_modules:
            if name == lora.name:
                card = _model_card(request, name, model.name, int(model.created_at.timestamp()),
                                   model.max_model_len)
                return web.json_response(card.model_copy(
                    update={"root": lora.path, "parent": model.name}).body())
    raise await st.client.no_instance(name)


def _model_card(request: web.Request, served: str, name: str, created: int,
                max_len: int | None) -> ModelCard:
    """vLLM's model card for a name the model answers to (root: the model that name serves,
    parent: null), the same listed or alone. max_model_len is what the engines serve (the
    model's config when it was not set)."""
    table = request.app[STATE].table
    return ModelCard(id=served, created=created, root=name,
                     max_model_len=table.max_model_len(name) or max_len,
                     has_running_instance=name in table.model_names())


@routes.post("/v1/completions")
async def completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = parse_body(await read_body(request), CompletionRequest)
    # an alias: the model's own name; an adapter: its base model, the adapter in each request
    body.model, lora = await st.names.resolve_lora(body.model)
    prompts = body.prompts()
    with st.admission.slot(len(prompts) * body.n, param="prompt" if len(prompts) > 1 else "n"):
        builder = CompletionResponseBuilder(lora or body.model,  # (keys' limits, usage: its name)
                                            want_logprobs=body.logprobs is not None)
        jobs = []
        for i, prompt in enumerate(prompts):
            hashes = (text_prefix_hashes(prompt) if isinstance(prompt, str)
                      else token_prefix_hashes(prompt))
            echo = prompt if body.echo and isinstance(prompt, str) else ""
            job = body.generate(f"{builder.id}-{i}", prompt)
            job.lora_name = lora
            jobs.append(Job(job, lora_prefix_hashes(hashes, lora), i * body.n, echo))
        answer = Answer(st.client, builder, jobs, body.n, st.metrics.observer(body.model),
                        body.include_usage,
                        body.continuous_usage)
        def tokens() -> int:
            return reservation([prompt_tokens(p) for p in prompts], body.n, body.max_tokens,
                               st.table.max_model_len(body.model))

        return await run_answer(request, answer, body.stream, body.spec()[1], tokens)


@routes.post("/v1/chat/completions")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    st = request.app[STATE]
    body = parse_body(await read_body(request), ChatCompletionRequest)
    body.model, lora = await st.names.resolve_lora(body.model)  # (as for completions)
    with st.admission.slot(body.n, param="n"):
        answer, tokens = chat_answer(request, body, lora)
        return await run_answer(request, answer, body.stream, body.spec()[1], tokens)


def chat_answer(request: web.Request, body: ChatCompletionRequest, lora: str | None = None
                ) -> tuple[Answer, Callable[[], int]]:
    """A chat request's answer, and the most tokens it may spend (for a key with limits); the
    Anthropic and Responses routes run theirs through this too, translated to chat."""
    st = request.app[STATE]
    builder = ChatResponseBuilder(lora or body.model, want_logprobs=body.logprobs,
                                  tool_mode=body.tool_plan().mode,
                                  tool_schemas=parameter_schemas(body.tools),
                                  parallel_tool_calls=body.parallel_tool_calls is not False,
                                  include_reasoning=body.include_reasoning,
                                  guided=body.spec()[0] is not None)
    hashes = messages_prefix_hashes([(m.role, m.text() or "") for m in body.messages])
    job = body.generate(builder.id)
    job.lora_name = lora
    jobs = [Job(job, lora_prefix_hashes(hashes, lora))]
    answer = Answer(st.client, builder, jobs, body.n, st.metrics.observer(body.model),
                    body.include_usage, body.continuous_usage)

    def tokens() -> int:
        texts = [m.text() or "" for m in body.messages] + [
            c.model_dump_json() for m in body.messages for c in m.tool_calls or []] + [
            t.model_dump_json() for t in body.tools or []]
        max_tokens = (body.max_completion_tokens if body.max_completion_tokens is not None
                      else body.max_tokens)
        prompt = chat_tokens(texts, st.table.chat_template_tokens(body.model))
        return reservation([prompt], body.n, max_tokens, st.table.max_model_len(body.model))

    return answer, tokens


async def run_answer(request: web.Request, answer: Answer, stream: bool,
                     spec_source: str | None, tokens: Callable[[], int],
                     respond: Callable[[], Awaitable[web.StreamResponse]] | None = None
                     ) -> web.StreamResponse:
    """Run the answer inside its GenAI span (whose traceparent rides to the engine) and a log
    context, counted against the key's limits and usage (quota.py), reserving `tokens()` (the
    most it may spend; estimated only for a key with limits) until its usage settles them. An
    engine 400 about the output constraint names the field the client sent. `respond` writes
    an answer in another API's shape (default: OpenAI's, streamed or whole)."""
    st = request.app[STATE]
    quota = st.quota
    answer.spec_source = spec_source
    ticket = await quota.admit(request, answer.builder.model, tokens)
    for k, job in enumerate(answer.jobs):  # for the engines, should this gateway die mid-stream
        job.request.usage = usage_tag(ticket, k)
    resource = request.match_info.route.resource
    api = resource.canonical if resource is not None else request.path
    st.metrics.api_requests.labels(api, answer.builder.model).inc()
    if respond is None:
        respond = (lambda: answer.stream(request)) if stream else answer.whole
    with log_context(request_id=answer.builder.id, model=answer.builder.model), \
            inference_span(answer.jobs[0].request, answer.builder, stream):
        answered = failed = False
        try:
            response = await respond()
            answered = True
            return response
        except InvalidRequest as exc:
            failed = True
            raise rename_param(exc, spec_source) from None
        except BaseException:
            failed = True
            raise
        finally:  # what was generated counts, also for a failed or abandoned answer
            usage = answer.builder.usage or answer.usage_so_far()
            if answered or usage.total_tokens:  # a refusal before any token is not usage
                quota.record(ticket, usage, answer.cut_record_id(failed))
            else:
                quota.release(ticket)


@routes.post("/tokenize")
async def tokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = parse_body(await read_body(request), TokenizeBody)
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    await st.quota.admit(request, body.model)  # a request under the key's limits; no usage
    messages = None
    if body.messages is not None:
        messages = ChatCompletionRequest(model=body.model, messages=body.messages).wire_messages()
    req = TokenizeRequest(model=body.model, prompt=body.prompt, messages=messages,
                          add_special_tokens=body.add_special_tokens,
                          add_generation_prompt=body.add_generation_prompt,
                          tools=[t.wire() for t in body.tools] if body.tools else None,
                          chat_template_kwargs=body.chat_template_kwargs)
    # as long as a generate request has to be accepted (its seq 0 also waits for the tokenizer)
    reply = await st.client.call(body.model, req, TokenizeReply, st.settings.gateway_accept_timeout)
    return web.json_response(TokenizeResponse(count=reply.count, max_model_len=reply.max_model_len,
                                              tokens=reply.tokens).body())


@routes.post("/detokenize")
async def detokenize(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = parse_body(await read_body(request), DetokenizeBody)
    body.model = await st.names.resolve(body.model)  # an alias: the model's own name
    await st.quota.admit(request, body.model)  # a request under the key's limits; no usage
    reply = await st.client.call(body.model,
                                 DetokenizeRequest(model=body.model, tokens=body.tokens),
                                 DetokenizeReply, st.settings.gateway_accept_timeout)
    return web.json_response(DetokenizeResponse(prompt=reply.prompt).body())
