"""Gateway metrics under vLLM's names: per-request observations (TTFT, inter-token latency, e2e,
queue time, token counts, successes by finish reason) plus the engines' live loads at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from prometheus_client import generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from shoal.shared.metrics import EngineLoadCollector, ServingMetrics, new_registry
from shoal.shared.schemas.infer import EngineLoad, InferChunk, InferEnd

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self, loads: Callable[[], Iterable[EngineLoad]]) -> None:
        self.registry = new_registry()
        self.requests = ServingMetrics(self.registry)
        self.registry.register(EngineLoadCollector(loads))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def observer(self, model: str) -> RequestObserver:
        return RequestObserver(self.requests, model)


class RequestObserver:
    """One request as its client sees it: first token, gaps between tokens, end."""

    def __init__(self, metrics: ServingMetrics, model: str) -> None:
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
        m, model = self.metrics, self.model
        m.e2e.labels(model).observe(time.perf_counter() - self.arrival)
        if end.queue_s is not None:
            m.queue.labels(model).observe(end.queue_s)
        m.prompt_tokens.labels(model).observe(end.usage.prompt_tokens)
        m.generation_tokens.labels(model).observe(end.usage.completion_tokens)
        for reason in end.finish_reasons.values() or ["stop"]:
            m.success.labels(model, reason).inc()
