"""The gateway's aiohttp application: middlewares (the edge's checks, tracing, errors, then
auth), routes (OpenAI, management, ops, and the dashboard with the API docs), and a cleanup
context that owns the bus connection and the live instance table for the app's lifetime.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from shoal.services.gateway.anthropic import routes as anthropic_routes
from shoal.services.gateway.auth import edge
from shoal.services.gateway.auth.admission import Admission
from shoal.services.gateway.auth.keys import (
    KeyCache, answer_gateway_info, auth_middleware, watch_keys
)
from shoal.services.gateway.auth.quota import Quota, add_ratelimit_headers
from shoal.services.gateway.errors import error_middleware
from shoal.services.gateway.management import routes as management_routes
from shoal.services.gateway.management.openapi import openapi_document
from shoal.services.gateway.management.ui import add_ui
from shoal.services.gateway.metrics import CONTENT_TYPE, GatewayMetrics
from shoal.services.gateway.openai import lora_routes, pooling_routes
from shoal.services.gateway.openai import routes as openai_routes
from shoal.services.gateway.responses_api import routes as responses_routes
from shoal.services.gateway.routing.infer_client import InferClient
from shoal.services.gateway.routing.instances import InstanceTable
from shoal.services.gateway.routing.model_names import ModelNames
from shoal.services.gateway.routing.router import Router
from shoal.services.gateway.state import STATE, GatewayState
from shoal.services.gateway.tracing import instrument_http
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.metrics_endpoint import (
    advertised_host,
    answer_discovery,
    discover_targets,
    http_sd,
)
from shoal.shared.schemas.metrics import MetricsTarget
from shoal.shared.version import VERSION

SETTINGS: web.AppKey[Settings] = web.AppKey("shoal_gateway_settings", Settings)
ops = web.RouteTableDef()


@ops.get("/health")
async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


@ops.get("/version")
async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": VERSION})


@ops.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = request.app[STATE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


@ops.get("/metrics/targets")
async def metrics_targets(request: web.Request) -> web.Response:
    """Every process's /metrics in Prometheus' HTTP service-discovery format (http_sd_configs):
    gateways, registries, scheduler replicas, workers and engines (shared/metrics_endpoint.py)."""
    return web.json_response(http_sd(await discover_targets(request.app[STATE].bus)))


@ops.get("/openapi.json")
async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(VERSION))


async def _lifetime(app: web.Application) -> AsyncIterator[None]:
    settings = app[SETTINGS]
    bus = await Bus.connect(settings, name="shoal-gateway")
    try:
        registry = RegistryClient(bus)
        router = Router()
        table = InstanceTable(bus, registry, settings, router)
        admission = Admission(settings.gateway_max_outstanding)
        keys = KeyCache(settings.gateway_key_cache_ttl, settings.gateway_key_stale_max)
        await watch_keys(bus, keys)
        metrics = GatewayMetrics(lambda: admission.num_requests)
        app[STATE] = GatewayState(
            settings=settings, bus=bus, registry=registry, router=router, table=table,
            client=InferClient(bus, registry, table, router, settings, metrics.count_failover),
            admission=admission, metrics=metrics,
            keys=keys, quota=Quota(registry, flush_interval=settings.gateway_usage_flush_interval,
                                   flush_requests=settings.gateway_usage_flush_requests),
            names=ModelNames(registry, table.model_names, ttl=settings.gateway_instance_refresh),
        )
        host = advertised_host(settings.gateway_host, settings.metrics_advertise_host)
        address = f"{host}:{settings.gateway_port}"
        await answer_discovery(bus, MetricsTarget(service="gateway", address=address))
        await answer_gateway_info(bus, settings, address)
        await table.start()
        try:
            yield
        finally:
            await app[STATE].quota.drain()  # usage records in flight reach the registry
            await table.stop()
    finally:
        await bus.close()


def make_app(settings: Settings) -> web.Application:
    """Build the app; the bus connects when it starts (aiohttp runner or test server)."""
    instrument_http()  # HTTP server spans (web.Application, wrapped before it is built here)
    app = web.Application(client_max_size=settings.gateway_max_body_bytes,
                          middlewares=[error_middleware, auth_middleware])
    edge.install(app, settings)
    app[SETTINGS] = settings
    app.cleanup_ctx.append(_lifetime)
    app.on_response_prepare.append(add_ratelimit_headers)
    app.add_routes(ops)
    app.add_routes(openai_routes.routes)
    app.add_routes(pooling_routes.routes)
    app.add_routes(anthropic_routes.routes)
    app.add_routes(lora_routes.routes)
    app.add_routes(responses_routes.routes)
    app.add_routes(management_routes.routes)
    add_ui(app)
    return app
