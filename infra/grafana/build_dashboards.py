"""Build the Grafana dashboards Shoal ships (infra/grafana/dashboards/*.json) from the panel
lists below: `python infra/grafana/build_dashboards.py` rewrites them, and
tests/unit/test_dashboards.py checks the files are what this script makes and that every
metric their queries name is one Shoal exposes.

- vllm.json: the panels and queries of vLLM's own Grafana dashboard
  (examples/observability/prometheus_grafana in vLLM's repository), so a vLLM user's view works
  unchanged on Shoal, plus the timings vLLM 0.32 added (inference time, time per output token,
  tokens per step);
- shoal-cluster.json: the control plane: workers and instances by state, pending placements and
  why, devices, the scheduler's leader, registry latency, the gateways' load.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
M = '{model_name="$model_name"}'
RATE = "[$__rate_interval]"


def quantiles(metric: str) -> list[tuple[str, str]]:
    """P99, P95, P90, P50 and the mean of a histogram, as vLLM's dashboard draws latencies."""
    out = [(f"histogram_quantile({q}, sum by(le) (rate({metric}_bucket{M}{RATE})))", f"P{p}")
           for q, p in (("0.99", 99), ("0.95", 95), ("0.9", 90), ("0.5", 50))]
    out.append((f"rate({metric}_sum{M}{RATE})\n/\nrate({metric}_count{M}{RATE})", "Average"))
    return out


VLLM_PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    # (title, panel type, unit, [(expr, legend)])
    ("E2E Request Latency", "timeseries", "s", quantiles("vllm:e2e_request_latency_seconds")),
    ("Token Throughput", "timeseries", "none",
     [(f"rate(vllm:prompt_tokens_total{M}{RATE})", "Prompt Tokens/Sec"),
      (f"rate(vllm:generation_tokens_total{M}{RATE})", "Generation Tokens/Sec")]),
    ("Inter Token Latency", "timeseries", "s", quantiles("vllm:inter_token_latency_seconds")),
    ("Scheduler State", "timeseries", "none",
     [(f"vllm:num_requests_running{M}", "Num Running"),
      (f"vllm:num_requests_waiting{M}", "Num Waiting")]),
    ("Time To First Token Latency", "timeseries", "s",
     quantiles("vllm:time_to_first_token_seconds")),
    ("Cache Utilization", "timeseries", "percentunit",
     [(f"vllm:kv_cache_usage_perc{M}", "GPU Cache Usage")]),
    ("Request Prompt Length", "heatmap", "none",
     [(f"sum by(le) (increase(vllm:request_prompt_tokens_bucket{M}{RATE}))", "{{le}}")]),
    ("Request Generation Length", "heatmap", "none",
     [(f"sum by(le) (increase(vllm:request_generation_tokens_bucket{M}{RATE}))", "{{le}}")]),
    ("Finish Reason", "timeseries", "none",
     [(f"sum by(finished_reason) (increase(vllm:request_success_total{M}{RATE}))", "__auto")]),
    ("Queue Time", "timeseries", "s",
     [(f"rate(vllm:request_queue_time_seconds_sum{M}{RATE})", "__auto")]),
    ("Requests Prefill and Decode Time", "timeseries", "s",
     [(f"rate(vllm:request_prefill_time_seconds_sum{M}{RATE})", "Prefill"),
      (f"rate(vllm:request_decode_time_seconds_sum{M}{RATE})", "Decode")]),
    ("Max Generation Token in Sequence Group", "timeseries", "none",
     [(f"rate(vllm:request_max_num_generation_tokens_sum{M}{RATE})", "Tokens")]),
    # vLLM 0.32's further timings
    ("Request Inference Time", "timeseries", "s",
     quantiles("vllm:request_inference_time_seconds")),
    ("Time per Output Token (per request)", "timeseries", "s",
     quantiles("vllm:request_time_per_output_token_seconds")),
    ("Tokens per Engine Step", "heatmap", "none",
     [(f"sum by(le) (increase(vllm:iteration_tokens_total_bucket{M}{RATE}))", "{{le}}")]),
    ("Prefix Cache Hit Rate", "timeseries", "percentunit",
     [(f"sum(rate(vllm:prefix_cache_hits_total{M}{RATE})) / "
       f"sum(rate(vllm:prefix_cache_queries_total{M}{RATE}))", "Hit rate")]),
    ("Requested n and max_tokens", "timeseries", "none",
     [(f"rate(vllm:request_params_n_sum{M}{RATE}) / rate(vllm:request_params_n_count{M}{RATE})",
       "mean n"),
      (f"rate(vllm:request_params_max_tokens_sum{M}{RATE}) / "
       f"rate(vllm:request_params_max_tokens_count{M}{RATE})", "mean max_tokens")]),
    ("Engines (KV-cache configuration)", "table", "none",
     [("vllm:cache_config_info", "{{engine}}")]),
]

CLUSTER_PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Workers by state", "timeseries", "none", [("sum by(state) (shoal:workers)", "{{state}}")]),
    ("Instances by state", "timeseries", "none",
     [("sum by(state) (shoal:instances)", "{{state}}")]),
    ("Instances by model and state", "table", "none",
     [("shoal:instances > 0", "{{model_name}} {{state}}")]),
    ("Pending placements and why", "table", "none",
     [("shoal:instance_pending_info", "{{instance_name}}: {{reason}}")]),
    ("Scheduler leader", "stat", "none",
     [("shoal:scheduler_is_leader == 1", "{{replica}}")]),
    ("Worker RAM used", "timeseries", "percentunit",
     [("shoal:worker_memory_used_bytes / shoal:worker_memory_total_bytes", "{{worker}}")]),
    ("GPU memory used", "timeseries", "percentunit",
     [("shoal:gpu_memory_used_bytes / shoal:gpu_memory_total_bytes", "{{worker}} GPU {{gpu}}")]),
    ("GPU utilisation", "timeseries", "percentunit",
     [("shoal:gpu_utilization", "{{worker}} GPU {{gpu}}")]),
    ("CPU cores", "stat", "none", [("sum(shoal:worker_cpu_cores)", "cores")]),
    ("Registry latency (P99 by endpoint)", "timeseries", "s",
     [('histogram_quantile(0.99, sum by(le, endpoint) (rate(shoal:bus_request_duration_seconds_'
       'bucket{service="shoal-registry"}[$__rate_interval])))', "{{endpoint}}")]),
    ("Registry errors", "timeseries", "none",
     [("sum by(endpoint, code) (rate(shoal:bus_request_errors_total[$__rate_interval]))",
       "{{endpoint}} {{code}}")]),
    ("Gateway requests in flight", "timeseries", "none",
     [("shoal:gateway_requests_in_flight", "{{instance}}")]),
    ("Running and waiting requests, all engines", "timeseries", "none",
     [("sum(vllm:num_requests_running)", "running"), ("sum(vllm:num_requests_waiting)",
                                                     "waiting")]),
    ("Generation tokens/s by model", "timeseries", "none",
     [("sum by(model_name) (rate(vllm:generation_tokens_total[$__rate_interval]))",
       "{{model_name}}")]),
]


def panel(i: int, title: str, kind: str, unit: str, targets: list[tuple[str, str]]) -> dict:
    body: dict[str, Any] = {
        "id": i + 1, "title": title, "type": kind, "datasource": DATASOURCE,
        "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [{"datasource": DATASOURCE, "expr": expr, "legendFormat": legend,
                     "refId": chr(ord("A") + k), "range": kind != "table",
                     "instant": kind == "table", **({"format": "heatmap"} if kind == "heatmap"
                                                    else {})}
                    for k, (expr, legend) in enumerate(targets)]}
    if kind == "heatmap":
        body["options"] = {"calculate": False, "yAxis": {"unit": "none"}}
    return body


def dashboard(uid: str, title: str, description: str, panels: list, model_variable: bool) -> dict:
    variables: list[dict[str, Any]] = [{"name": "DS_PROMETHEUS", "label": "datasource",
                                        "type": "datasource", "query": "prometheus"}]
    if model_variable:
        variables.append({"name": "model_name", "label": "model_name", "type": "query",
                          "datasource": DATASOURCE, "refresh": 1,
                          "definition": "label_values(model_name)",
                          "query": {"query": "label_values(model_name)",
                                    "refId": "StandardVariableQuery"}})
    return {"uid": uid, "title": title, "description": description, "editable": True,
            "schemaVersion": 39, "version": 1, "refresh": "10s", "tags": ["shoal"],
            "time": {"from": "now-30m", "to": "now"}, "templating": {"list": variables},
            "panels": [panel(i, *p) for i, p in enumerate(panels)]}


def build() -> dict[str, dict]:
    return {
        "vllm.json": dashboard("shoal-vllm", "vLLM (served by Shoal)",
                               "vLLM's serving dashboard: its panels and queries, on Shoal",
                               VLLM_PANELS, model_variable=True),
        "shoal-cluster.json": dashboard("shoal-cluster", "Shoal cluster",
                                        "Workers, instances, placements, devices, control plane",
                                        CLUSTER_PANELS, model_variable=False),
    }


def render(board: dict) -> str:
    return json.dumps(board, indent=2) + "\n"


if __name__ == "__main__":
    HERE.mkdir(parents=True, exist_ok=True)
    for name, board in build().items():
        (HERE / name).write_text(render(board))
        print(f"wrote {HERE / name}")
