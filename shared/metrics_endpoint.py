"""Every process's /metrics, and how Prometheus finds them all.

Each metric lives in exactly one process, so a Prometheus that scrapes every target adds up
right (docs/observability.md): the gateways observe what their clients see, each engine its own
state and requests, each worker its devices, the scheduler leader the cluster's state, each
registry its request latency. Processes without an HTTP server of their own (registry,
scheduler, worker, engine) serve /metrics on a small aiohttp site; every process answers
`shoal.metrics.targets` with its address, and a gateway's /metrics/targets gathers the answers
in Prometheus' HTTP service-discovery format, as GPUStack's server lists its workers.
"""

from __future__ import annotations

import logging
import socket
from typing import Any

from aiohttp import web
from nats.aio.subscription import Subscription
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.shared.bus.client import Bus
from shoal.shared.bus.gather import answer, gather
from shoal.shared.config import Settings
from shoal.shared.schemas.metrics import MetricsTarget

log = logging.getLogger(__name__)
DISCOVERY_WAIT_S = 0.5
"""How long a gateway gathers answers to shoal.metrics.targets."""


def advertised_host(host: str, advertise: str | None = None) -> str:
    """The address others reach a listener by. A wildcard bind advertises this machine's own
    address (a container's IP, unique even for scaled replicas), or its name when that only
    resolves to a loopback address."""
    if advertise:
        return advertise
    if host not in ("0.0.0.0", "::", ""):
        return host
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return name
    return name if address.startswith("127.") else address


async def answer_discovery(bus: Bus, target: MetricsTarget) -> Subscription:
    """Reply with `target` to every shoal.<ns>.metrics.targets request (no queue group: all
    answer)."""
    return await answer(bus, bus.subjects.metrics_targets, target)


async def discover_targets(bus: Bus, wait: float = DISCOVERY_WAIT_S) -> list[MetricsTarget]:
    """Every target that answers within `wait` seconds, sorted by service and address."""
    found = {t.address: t for t in await gather(bus, bus.subjects.metrics_targets,
                                                  MetricsTarget, wait)}
    return sorted(found.values(), key=lambda t: (t.service, t.address))


def http_sd(targets: list[MetricsTarget]) -> list[dict[str, Any]]:
    """Prometheus' http_sd_configs body: one group per target, labelled with its service."""
    return [{"targets": [t.address], "labels": {"shoal_service": t.service, **t.labels}}
            for t in targets]


def metrics_response(registry: CollectorRegistry) -> web.Response:
    return web.Response(body=generate_latest(registry),
                        headers={"Content-Type": CONTENT_TYPE_LATEST})


class MetricsEndpoint:
    """/metrics of one process on its own small HTTP site, announced on the bus."""

    def __init__(self, registry: CollectorRegistry, service: str, settings: Settings,
                 labels: dict[str, str] | None = None, port: int | None = None) -> None:
        self.registry = registry
        self.service = service
        self.settings = settings
        self.labels = labels or {}
        self.port = settings.metrics_port if port is None else port
        self.runner: web.AppRunner | None = None
        self.subscription: Subscription | None = None
        self.target: MetricsTarget | None = None

    async def start(self, bus: Bus) -> MetricsTarget:
        app = web.Application()
        app.router.add_get("/metrics", lambda _request: metrics_response(self.registry))
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, self.settings.metrics_host, self.port)
        await site.start()
        port = self.runner.addresses[0][1]
        host = advertised_host(self.settings.metrics_host, self.settings.metrics_advertise_host)
        self.target = MetricsTarget(service=self.service, address=f"{host}:{port}",
                                    labels=self.labels)
        self.subscription = await answer_discovery(bus, self.target)
        log.info("%s metrics on http://%s/metrics", self.service, self.target.address)
        return self.target

    async def stop(self) -> None:
        if self.subscription is not None:
            try:
                await self.subscription.unsubscribe()
            except Exception:  # noqa: BLE001 - the connection may be closing
                pass
            self.subscription = None
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None
