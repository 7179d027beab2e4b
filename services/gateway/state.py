"""The gateway's state, held in the aiohttp app under one typed `web.AppKey`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from aiohttp import web

from shoal.services.gateway.admission import Admission
from shoal.services.gateway.auth import KeyCache
from shoal.services.gateway.infer_client import InferClient
from shoal.services.gateway.instances import InstanceTable
from shoal.services.gateway.metrics import GatewayMetrics
from shoal.services.gateway.model_names import ModelNames
from shoal.services.gateway.quota import Quota
from shoal.services.gateway.router import Router
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
