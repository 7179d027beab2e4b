"""vLLM's runtime LoRA endpoints: POST /v1/load_lora_adapter and /v1/unload_lora_adapter, with
vLLM's bodies ({"lora_name", "lora_path"}; {"lora_name"}) and its answers ("Success: ..." text).

An adapter belongs to a model (its lora_modules, in the registry), so every instance of the
model serves it, today's and later ones: loading adds it to the model's spec, unloading takes it
out. `base_model_name` says which model (needed only when several models have enable_lora).
Loading then runs a one-token request with the adapter on an instance of the model, so the engine
reads and checks it now: an adapter it refuses (rank, targets, shapes, a corrupt file) is taken
out of the spec again and the engine's 400 with the reason is the answer; with no instance to ask
(all busy starting, or gone, or the model scaled to zero) it is taken out too and the answer is
that 503 (retry later): no adapter enters the spec unchecked. Both need an admin key
(they change what the cluster serves; vLLM gates them behind VLLM_ALLOW_RUNTIME_LORA_UPDATING).
"""

from __future__ import annotations

import uuid

from aiohttp import web
from pydantic import Field

from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import parse_body
from shoal.services.gateway.openai.body import Body
from shoal.services.gateway.routing.router import lora_prefix_hashes
from shoal.services.gateway.state import STATE
from shoal.shared.errors import InvalidRequest, NotFound, ShoalError
from shoal.shared.schemas.infer import GenerateRequest, SamplingOptions
from shoal.shared.schemas.registry import LoRAModule, ModelPublic, ModelUpdate

routes = web.RouteTableDef()


class LoadLoRABody(Body):
    lora_name: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/-]*$")
    lora_path: str = Field(min_length=1)
    base_model_name: str | None = None
    """Shoal's addition: the model the adapter is for, when several have enable_lora."""


class UnloadLoRABody(Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None
    """vLLM's field; adapters are named here, so it is not needed."""


@routes.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = parse_body(await read_body(request), LoadLoRABody)
    models = await st.registry.list_models()
    name = body.lora_name
    for m in models:
        if name == m.name or name in m.aliases:
            raise InvalidRequest(f"{name!r} is the name of a model", param="lora_name")
        if any(lora.name == name for lora in m.lora_modules):
            raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.",
                                 param="lora_name")
    model = _base_model(models, body.base_model_name)
    module = LoRAModule(name=name, path=body.lora_path, base_model_name=body.base_model_name)
    updated = await st.registry.update_model(ModelUpdate(
        id=model.id, version=model.version, lora_modules=[*model.lora_modules, module]))
    st.names.invalidate()
    if model.replicas > 0:  # an engine reads and checks it now
        probe = GenerateRequest(request_id=f"load-lora-{uuid.uuid4().hex}", model=model.name,
                                prompt_token_ids=[0], sampling=SamplingOptions(max_tokens=1),
                                lora_name=name)
        try:
            async for _ in st.client.generate(probe, lora_prefix_hashes([], name)):
                pass
        except ShoalError:  # refused (400), or no engine to check it now (503, retry later):
            await st.registry.update_model(ModelUpdate(  # the model no longer lists it
                id=updated.id, version=updated.version, lora_modules=model.lora_modules))
            st.names.invalidate()
            raise
    return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")


@routes.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: web.Request) -> web.Response:
    st = request.app[STATE]
    body = parse_body(await read_body(request), UnloadLoRABody)
    for m in await st.registry.list_models():
        kept = [lora for lora in m.lora_modules if lora.name != body.lora_name]
        if len(kept) < len(m.lora_modules):
            await st.registry.update_model(ModelUpdate(id=m.id, version=m.version,
                                                       lora_modules=kept))
            st.names.invalidate()
            return web.Response(
                text=f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
    raise NotFound(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")


def _base_model(models: list[ModelPublic], base: str | None) -> ModelPublic:
    with_lora = [m for m in models if m.engine_args.enable_lora]
    if base is not None:
        for m in models:
            if base == m.name or base in m.aliases:
                if not m.engine_args.enable_lora:
                    raise InvalidRequest(f"model {m.name!r} was deployed without enable_lora",
                                         param="base_model_name")
                return m
        raise NotFound(f"The model '{base}' does not exist.", param="base_model_name")
    if len(with_lora) == 1:
        return with_lora[0]
    if not with_lora:
        raise InvalidRequest("no model serves LoRA adapters (deploy one with enable_lora)",
                             param="lora_name")
    raise InvalidRequest(f"several models serve LoRA adapters "
                         f"({', '.join(m.name for m in with_lora)}): name one in base_model_name",
                         param="base_model_name")
