"""Scale from zero at the gateway (real NATS, registry, gateway; no engine): a request for an
autoscaled model with no running instance asks the scheduler for one (ScaleDemand on the bus,
repeated while it waits) and, when none starts in time, gets a clear 503; a model without
autoscaling answers 503 at once, as before."""

from __future__ import annotations

import time
import uuid

import aiohttp
import pytest

from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings
from shoal.shared.schemas.registry import AutoscaleSpec, ModelCreate
from shoal.shared.schemas.scheduler import ScaleDemand
from tests.integration.test_gateway import running_gateway

pytestmark = pytest.mark.integration


async def test_cold_start_asks_for_an_instance_then_times_out(settings: Settings, bus: Bus,
                                                             client: RegistryClient) -> None:
    name = f"cold-{uuid.uuid4().hex[:6]}"
    await client.create_model(ModelCreate(
        name=name, source="/nonexistent/model", replicas=0,
        autoscaling=AutoscaleSpec(min_replicas=0, max_replicas=2, target=1.0)))
    plain = f"plain-{uuid.uuid4().hex[:6]}"
    await client.create_model(ModelCreate(name=plain, source="/nonexistent/model", replicas=0))
    demands: list[str] = []

    async def on_demand(demand: ScaleDemand, _msg: object) -> None:
        demands.append(demand.model)

    sub = await bus.subscribe(bus.subjects.autoscale_demand, ScaleDemand, on_demand)
    quick = settings.model_copy(update={"gateway_cold_start_timeout": 2.5})
    try:
        async with running_gateway(quick) as url, aiohttp.ClientSession() as http:
            body = {"model": name, "input": "hello"}
            start = time.monotonic()
            async with http.post(f"{url}/v1/embeddings", json=body) as r:
                waited = time.monotonic() - start
                error = (await r.json())["error"]
                assert r.status == 503 and error["code"] == "cold_start_timeout"
                assert "scaled to zero" in error["message"] and "2.5 s" in error["message"]
            assert 2.5 <= waited < 10
            assert demands.count(name) >= 2  # repeated while it waited
            start = time.monotonic()
            async with http.post(f"{url}/v1/embeddings", json={**body, "model": plain}) as r:
                assert r.status == 503 and time.monotonic() - start < 2
            assert plain not in demands
            # the scale events are the autoscaler's to write
            async with http.patch(f"{url}/api/v1/models/{name}", json={"scale_event": {
                    "at": "2026-01-01T00:00:00Z", "from_replicas": 0, "to_replicas": 9,
                    "reason": "made up"}}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "scale_event"
    finally:
        await sub.unsubscribe()
