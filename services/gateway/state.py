"""The gateway's state, held in the aiohttp app under one typed `web.AppKey`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from shoal.services.gateway.auth.admission import Admission
from shoal.services.gateway.auth.keys import KeyCache
from shoal.services.gateway.auth.quota import Quota
from shoal.services.gateway.metrics import GatewayMetrics
from shoal.services.gateway.routing.infer_client import InferClient
from shoal.services.gateway.routing.instances import InstanceTable
from shoal.services.gateway.routing.model_names import ModelNames
from shoal.services.gateway.routing.router import Router
from shoal.shared.bus.client import Bus
from shoal.shared.bus.registry_client import RegistryClient
from shoal.shared.config import Settings


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    bus: Bus
    registry: RegistryClient
    router: Router
    table: InstanceTable
    client: InferClient
    admission: Admission
    metrics: GatewayMetrics
    keys: KeyCache
    quota: Quota
    names: ModelNames
    """A request's model name or alias -> the model's name (model_names.py)."""
    started_at: float = field(default_factory=time.time)


STATE: web.AppKey[GatewayState] = web.AppKey("shoal_gateway_state", GatewayState)
