"""Gateway metrics: what its clients see per request, under vLLM's names (TTFT, inter-token
latency, end-to-end latency; shared/metrics.py ClientMetrics), and the gateway's own load.
Engines' state and per-request phases are not here: each engine serves its own, so that with
several gateways nothing is counted twice (docs/observability.md).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import Counter, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from shoal.shared.metrics import ClientMetrics, new_registry
from shoal.shared.schemas.infer import InferChunk, InferEnd

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, in_flight: Callable[[], int] = lambda: 0) -> None:
        self.registry = new_registry()
        self.requests = ClientMetrics(self.registry)
        self.api_requests = Counter(
            "shoal:gateway_api_requests", "Inference requests admitted, by the API route they "
            "came by (OpenAI's chat and completions, Anthropic's messages, OpenAI's responses, "
            "vLLM's score and rerank).",
            ["api", "model_name"], registry=self.registry)
        self.failovers = Counter(
            "shoal:gateway_stream_failovers", "Started streams whose engine died, by outcome: "
            "resumed on another replica, or why not (no_replica, not_reproducible: sampling "
            "without a seed, n_above_1, structured_output), when the stream ended with an error "
            "event.", ["model_name", "outcome"], registry=self.registry)
        self.registry.register(_InFlight(in_flight))

    def count_failover(self, model: str, outcome: str) -> None:
        self.failovers.labels(model, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observer(self, model: str) -> RequestObserver:
        return RequestObserver(self.requests, model)


class _InFlight(Collector):
    def __init__(self, in_flight: Callable[[], int]) -> None:
        self._in_flight = in_flight

    def collect(self):  # noqa: ANN201 - prometheus_client's collector protocol
        yield GaugeMetricFamily("shoal:gateway_requests_in_flight",
                                "Inference requests this gateway holds (admitted, not answered).",
                                value=self._in_flight())


class RequestObserver:
    """One request as its client sees it: first token, gaps between tokens, end."""

    def __init__(self, metrics: ClientMetrics, model: str) -> None:
        self.metrics = metrics
        self.model = model
        self.arrival = time.perf_counter()
        self.last_token: float | None = None

    def on_chunk(self, chunk: InferChunk) -> None:
        num_tokens = sum(len(c.token_ids) for c in chunk.choices)
        if num_tokens == 0:
            return
        now = time.perf_counter()
        if self.last_token is None:
            self.metrics.ttft.labels(self.model).observe(now - self.arrival)
            num_tokens -= 1
        elif num_tokens:
            gap = (now - self.last_token) / num_tokens
            for _ in range(num_tokens):
                self.metrics.itl.labels(self.model).observe(gap)
        self.last_token = now

    def on_end(self, end: InferEnd) -> None:
        self.metrics.e2e.labels(self.model).observe(time.perf_counter() - self.arrival)
