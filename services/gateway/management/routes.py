"""Management API over the registry: /api/v1/{models,instances,workers,keys}.

Bodies are the registry's own pydantic payloads (unknown fields refused, 400); a stale `version`
comes back from the registry as Conflict, answered 409; nothing is written on either.
`POST /api/v1/models?dry_run=true` asks the scheduler where the model would go, over the bus
(shoal.scheduler.placement.plan), and writes nothing; a deploy asks it too and is refused what
the dry run refuses (shared/bus/deploy.py).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from shoal.services.gateway.auth.keys import keys_required
from shoal.services.gateway.auth.quota import API_KEY
from shoal.services.gateway.errors import read_body
from shoal.services.gateway.json_body import load_json, parse_body
from shoal.services.gateway.state import STATE
from shoal.shared.bus.deploy import check_update, deploy
from shoal.shared.bus.scheduler_client import SchedulerClient
from shoal.shared.errors import InvalidRequest, NotFound
from shoal.shared.schemas.registry import (
    ApiKeyCreate, ApiKeyUpdate, DeleteRequest, InstanceFilter, ListRequest, ModelCreate,
    ModelPublic, ModelUpdate, UsageQuery
)
from shoal.shared.states import InstanceState

routes = web.RouteTableDef()


def _json(item: BaseModel | list[BaseModel], status: int = 200) -> web.Response:
    if isinstance(item, list):
        body: Any = {"items": [i.model_dump(mode="json") for i in item], "total": len(item)}
    else:
        body = item.model_dump(mode="json")
    return web.json_response(body, status=status)


def _int_query(request: web.Request, name: str, default: int | None) -> int | None:
    raw = request.query.get(name)
    if raw is None:
        return default
    try:
        return int(raw)
    except ValueError:
        raise InvalidRequest(f"{name} must be an integer, got {raw!r}", param=name) from None


def _bool_query(request: web.Request, name: str) -> bool:
    raw = request.query.get(name, "false").lower()
    if raw not in ("true", "1", "false", "0"):
        raise InvalidRequest(f"{name} must be true or false, got {raw!r}", param=name)
    return raw in ("true", "1")


def _page(request: web.Request) -> ListRequest:
    try:
        return ListRequest(limit=_int_query(request, "limit", 1000),
                           offset=_int_query(request, "offset", 0))
    except ValueError as exc:
        raise InvalidRequest(f"bad paging: {exc}", param="limit") from None


def _delete(request: web.Request) -> DeleteRequest:
    return DeleteRequest(id=request.match_info["id"], version=_int_query(request, "version", None))


# ---------------------------------------------------------------- models
@routes.get("/api/v1/models")
async def list_models(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.list_models(_page(request)))


@routes.post("/api/v1/models")
async def create_model(request: web.Request) -> web.Response:
    body = parse_body(await read_body(request), ModelCreate)
    st = request.app[STATE]
    if _bool_query(request, "dry_run"):
        return _json(await SchedulerClient(st.bus).plan(body))
    return _json(await deploy(st.bus, body), status=201)  # what the dry run refuses: a 400


async def _model(request: web.Request, key: str) -> ModelPublic:
    registry = request.app[STATE].registry
    try:
        return await registry.get_model(id=key)
    except NotFound:
        return await registry.get_model(name=key)


@routes.get("/api/v1/models/{id}")
async def get_model(request: web.Request) -> web.Response:
    return _json(await _model(request, request.match_info["id"]))


@routes.patch("/api/v1/models/{id}")
async def update_model(request: web.Request) -> web.Response:
    data = load_json(await read_body(request))
    if "scale_event" in data:
        raise InvalidRequest("scale_event is written by the scheduler's autoscaler only",
                             param="scale_event")
    model = await _model(request, request.match_info["id"])
    body = parse_body(json.dumps({**data, "id": model.id}).encode(), ModelUpdate)
    await check_update(request.app[STATE].bus, model, body)  # refused what a deploy would be
    return _json(await request.app[STATE].registry.update_model(body))


@routes.delete("/api/v1/models/{id}")
async def delete_model(request: web.Request) -> web.Response:
    model = await _model(request, request.match_info["id"])
    req = DeleteRequest(id=model.id, version=_int_query(request, "version", None))
    return _json(await request.app[STATE].registry.delete_model(req))


# ---------------------------------------------------------------- instances
@routes.get("/api/v1/instances")
async def list_instances(request: web.Request) -> web.Response:
    q = request.query
    state = q.get("state")
    if state is not None and state.upper() not in InstanceState.__members__:
        raise InvalidRequest(f"unknown state {state!r}", param="state")
    model_id = q.get("model_id")
    if model_id is None and q.get("model"):
        model_id = (await _model(request, q["model"])).id
    flt = InstanceFilter(model_id=model_id, worker_id=q.get("worker_id"),
                         state=InstanceState[state.upper()] if state else None)
    return _json(await request.app[STATE].registry.list_instances(flt))


@routes.get("/api/v1/instances/{id}")
async def get_instance(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.get_instance(request.match_info["id"]))


@routes.delete("/api/v1/instances/{id}")
async def delete_instance(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.delete_instance(_delete(request)))


# ---------------------------------------------------------------- live engine loads
@routes.get("/api/v1/loads")
async def list_loads(request: web.Request) -> web.Response:
    """What each live engine last published on shoal.load.<id> (running, waiting, KV-cache use,
    cumulative token counters), as this gateway routes by it: the dashboard's live charts. Not
    a Prometheus metric: each engine serves those itself."""
    return _json(request.app[STATE].table.live_loads())


# ---------------------------------------------------------------- workers
@routes.get("/api/v1/workers")
async def list_workers(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.list_workers(_page(request)))


@routes.get("/api/v1/workers/{id}")
async def get_worker(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.get_worker(request.match_info["id"]))


@routes.delete("/api/v1/workers/{id}")
async def delete_worker(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.delete_worker(_delete(request)))


# ---------------------------------------------------------------- API keys
@routes.get("/api/v1/auth")
async def auth_info(request: web.Request) -> web.Response:
    """Whether this gateway requires keys, and the key this request presented (None: none):
    the dashboard says so on its API keys page when keys are not required."""
    settings, key = request.app[STATE].settings, request.get(API_KEY)
    return web.json_response({
        "keys_required": keys_required(settings), "fixed_key": bool(settings.api_key),
        "key": None if key is None else {"id": key.key_id, "name": key.name,
                                         "scope": key.scope.value if key.scope else None}})


@routes.get("/api/v1/keys")
async def list_keys(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.list_keys(_page(request)))


@routes.get("/api/v1/keys/{id}")
async def get_key(request: web.Request) -> web.Response:
    """A key by id or name (the registry resolves names for every key route)."""
    return _json(await request.app[STATE].registry.get_key(request.match_info["id"]))


@routes.post("/api/v1/keys")
async def create_key(request: web.Request) -> web.Response:
    body = parse_body(await read_body(request), ApiKeyCreate)
    return _json(await request.app[STATE].registry.create_key(body), status=201)


@routes.patch("/api/v1/keys/{id}")
async def update_key(request: web.Request) -> web.Response:
    """Change a key's scope or replace its limits: {"scope", "limits", "version"}; {id} is
    the key's id or name, as on every key route."""
    data = load_json(await read_body(request))
    body = parse_body(json.dumps({**data, "id": request.match_info["id"]}).encode(), ApiKeyUpdate)
    return _json(await request.app[STATE].registry.update_key(body))


@routes.get("/api/v1/usage")
async def usage(request: web.Request) -> web.Response:
    """Usage per key, model and UTC day (?key_id, ?model, ?since, ?until: YYYY-MM-DD)."""
    query = {k: request.query[k] for k in ("key_id", "model", "since", "until")
             if k in request.query}
    body = parse_body(json.dumps(query).encode(), UsageQuery)
    if body.key_id is not None:  # an id or a name; an unknown key is a 404, not no rows
        key = await request.app[STATE].registry.get_key(body.key_id)
        body = body.model_copy(update={"key_id": key.id})
    report = await request.app[STATE].registry.usage(body)
    return web.json_response({"items": [r.model_dump(mode="json") for r in report.rows],
                              "total": len(report.rows)})


@routes.delete("/api/v1/keys/{id}")
async def revoke_key(request: web.Request) -> web.Response:
    return _json(await request.app[STATE].registry.revoke_key(request.match_info["id"]))
