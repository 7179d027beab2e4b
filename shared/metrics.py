"""Prometheus metrics under vLLM's names, so vLLM's dashboards work unchanged, split by where
each is observed (every name lives in one kind of process, so sums over all targets add up):

- `ClientMetrics`, in the gateways: what clients see per request (TTFT, inter-token latency,
  end-to-end latency), each request counted by the one gateway that served it;
- `EngineLoadCollector`, in each engine: its state (running, waiting, KV use, prefix cache,
  cumulative tokens, preemptions), labelled by model and engine (the instance id); the engine's
  per-request histograms are in services/engine/server/metrics.py.

Buckets are vLLM 0.32's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.shared.schemas.infer import EngineLoad

REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
ITERATION_TOKENS_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)


def token_buckets(max_model_len: int) -> list[int]:
    """vLLM's request-token buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class ClientMetrics:
    """What the gateway observes per request, as its clients see it (label: model_name)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds",
                              "Time to first token, as the client sees it.", labels,
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds",
                             "Inter-token latency, as the client sees it.", labels,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels, buckets=REQUEST_LATENCY_BUCKETS, registry=registry)


class EngineLoadCollector(Collector):
    """An engine's state at scrape time, from its loads (gauges and cumulative counters)."""

    def __init__(self, loads: Callable[[], Iterable[EngineLoad]]) -> None:
        self._loads = loads

    def collect(self) -> Iterator[Metric]:
        labels = ["model_name", "engine"]
        gauges = {
            "num_requests_running": GaugeMetricFamily("vllm:num_requests_running",
                                                      "Requests running.", labels=labels),
            "num_requests_waiting": GaugeMetricFamily("vllm:num_requests_waiting",
                                                      "Requests waiting.", labels=labels),
            "kv_cache_usage_perc": GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                                     "KV-cache use, 1 = full.", labels=labels),
        }
        counters = {
            "prompt_tokens": CounterMetricFamily("vllm:prompt_tokens", "Prefill tokens processed.",
                                                 labels=labels),
            "generation_tokens": CounterMetricFamily("vllm:generation_tokens", "Tokens generated.",
                                                     labels=labels),
            "num_preemptions": CounterMetricFamily("vllm:num_preemptions", "Preemptions.",
                                                   labels=labels),
            "prefix_cache_queries": CounterMetricFamily("vllm:prefix_cache_queries",
                                                        "Prefix-cache queried tokens.",
                                                        labels=labels),
            "prefix_cache_hits": CounterMetricFamily("vllm:prefix_cache_hits",
                                                     "Prefix-cache hit tokens.", labels=labels),
        }
        for load in self._loads():
            values = [load.model_name, load.instance_id]
            gauges["num_requests_running"].add_metric(values, load.num_running)
            gauges["num_requests_waiting"].add_metric(values, load.num_waiting)
            gauges["kv_cache_usage_perc"].add_metric(values, load.kv_cache_usage)
            counters["prompt_tokens"].add_metric(values, load.prompt_tokens)
            counters["generation_tokens"].add_metric(values, load.generation_tokens)
            counters["num_preemptions"].add_metric(values, load.num_preemptions)
            counters["prefix_cache_queries"].add_metric(values, load.prefix_cache_queries)
            counters["prefix_cache_hits"].add_metric(values, load.prefix_cache_hits)
        yield from gauges.values()
        yield from counters.values()


def new_registry() -> CollectorRegistry:
    """A registry per process (no global default registry, so tests can build several)."""
    return CollectorRegistry(auto_describe=True)
