"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Per-request figures (TTFT, inter-token latency, e2e, queue time, token counts, successes) are
observed by the gateway as its clients see them. Engine-side gauges and cumulative counters
(running, waiting, KV-cache use, preemptions, prefix-cache queries and hits, token totals) come
from the engines' load messages through `EngineLoadCollector`, labelled by model and instance.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.shared.schemas.infer import EngineLoad

LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                   7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class ServingMetrics:
    """What the gateway observes per request, as its clients see it (label: model_name); the
    engine's own per-request record is request_output.RequestMetrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        labels = ["model_name"]
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.", labels,
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Inter-token latency.", labels,
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "End-to-end request latency.",
                             labels,
                             buckets=LATENCY_BUCKETS, registry=registry)
        self.queue = Histogram("vllm:request_queue_time_seconds",
                               "Time spent waiting in the engine queue.",
                               labels, buckets=LATENCY_BUCKETS, registry=registry)
        self.prompt_tokens = Histogram("vllm:request_prompt_tokens", "Prompt tokens per request.",
                                       labels,
                                       buckets=TOKEN_BUCKETS, registry=registry)
        self.generation_tokens = Histogram("vllm:request_generation_tokens",
                                           "Generated tokens per request.",
                                           labels, buckets=TOKEN_BUCKETS, registry=registry)
        self.success = Counter("vllm:request_success", "Finished requests by finish reason.",
                               ["model_name", "finished_reason"], registry=registry)


class EngineLoadCollector(Collector):
    """Exports the latest load of every live instance (gauges and cumulative counters)."""

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
