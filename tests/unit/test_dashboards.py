"""The Grafana dashboards and the Prometheus config Shoal ships (infra/): the files are what
infra/grafana/build_dashboards.py makes, vLLM's dashboard's 15 metrics are all queried, and
every metric any query names is exposed by one of Shoal's processes (their real collectors,
built here as each process builds them). The e2e serving test checks the same names against
a live stack's scrapes."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import yaml
from prometheus_client import CollectorRegistry

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.core.request_output import RequestMetrics
from shoal.services.engine.server.metrics import EngineMetrics, cache_info
from shoal.services.gateway.metrics import GatewayMetrics
from shoal.services.scheduler.metrics import SchedulerCollector
from shoal.services.worker.metrics import DeviceCollector
from shoal.shared.bus.service import RpcService
from shoal.shared.schemas.infer import EngineLoad, InferChunk, InferEnd, SamplingOptions, Usage
from shoal.shared.schemas.registry import DeviceStatus, GpuDevice
from shoal.shared.states import InstanceState

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "infra" / "grafana"
VLLM_DASHBOARD_METRICS = {
    "vllm:e2e_request_latency_seconds", "vllm:prompt_tokens", "vllm:generation_tokens",
    "vllm:inter_token_latency_seconds", "vllm:num_requests_running",
    "vllm:num_requests_waiting", "vllm:time_to_first_token_seconds", "vllm:kv_cache_usage_perc",
    "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_success",
    "vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds",
    "vllm:request_decode_time_seconds", "vllm:request_max_num_generation_tokens"}
"""What vLLM's own Grafana dashboard (examples/observability/prometheus_grafana) queries."""
METRIC = re.compile(r"\b((?:vllm|shoal):[a-z0-9_]+)")
SUFFIXES = ("_bucket", "_sum", "_count", "_total")


def dashboard_queries() -> dict[str, list[str]]:
    return {path.name: [t["expr"] for p in json.loads(path.read_text())["panels"]
                        for t in p["targets"]]
            for path in sorted((GRAFANA / "dashboards").glob("*.json"))}


def queried_metrics() -> set[str]:
    """Every metric name the dashboards' queries use, as exposed (histogram series included)."""
    return {m for exprs in dashboard_queries().values() for e in exprs for m in METRIC.findall(e)}


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def declared_series(exposition: str) -> set[str]:
    """The series names a scrape's `# TYPE` lines declare, samples or not (a gauge family of GPUs
    on a machine without one is declared, with no series)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            names.add(name)
            if kind == "histogram":
                names.update(f"{name}{s}" for s in ("_bucket", "_sum", "_count"))
    return names


def exposed(registry: CollectorRegistry) -> set[str]:
    """Every series name a scrape of `registry` shows (families and their samples)."""
    names = set()
    for metric in registry.collect():
        names.add(metric.name)
        names.update(sample.name for sample in metric.samples)
    return names


def shoal_registries() -> list[CollectorRegistry]:
    """Each process's registry, with what a scrape holds after some traffic."""
    load = EngineLoad(instance_id="i", model_name="m", num_running=1, num_waiting=0,
                      kv_cache_usage=0.1, max_num_seqs=8, max_model_len=512)
    engine = EngineMetrics("m", "i", 512, lambda: load, cache_info(EngineConfig(model="x"), 64))
    engine.iteration_tokens.observe(8)
    engine.on_finished(RequestMetrics(0.0, 0.1, 0.2, 0.5, 0.5), SamplingOptions(max_tokens=8),
                       5, {0: 4}, {0: "stop"})
    gateway = GatewayMetrics()
    observer = gateway.observer("m")
    for n in (1, 2):
        observer.on_chunk(InferChunk.model_validate(
            {"request_id": "r", "seq": n, "choices": [{"index": 0, "text": "a",
                                                         "token_ids": [1] * n}]}))
    observer.on_end(InferEnd(request_id="r", seq=3, usage=Usage(prompt_tokens=1,
                                                               completion_tokens=3),
                             instance_id="i"))
    worker = CollectorRegistry()
    worker.register(DeviceCollector("w", lambda: DeviceStatus(
        cpu_cores=2, memory_total=8, memory_used=4,
        gpus=[GpuDevice(index=0, name="H100", memory_total=80, memory_used=1, utilization=50)])))
    registry = CollectorRegistry()
    rpc = RpcService(None, "shoal-registry", "0", "shoal.registry", metrics=registry)  # type: ignore[arg-type]
    rpc._observe("models.list", 0.0, None)
    rpc._observe("models.get", 0.0, "404")
    workers = [SimpleNamespace(state=s) for s in ("READY",)]
    instances = [SimpleNamespace(model_name="m", name="m-1", state=s, state_message="no GPU")
                 for s in (InstanceState.PENDING,)]
    scheduler = CollectorRegistry()
    service = SimpleNamespace(snapshot=(workers, instances))
    scheduler.register(SchedulerCollector("s-1", SimpleNamespace(term=object()), service))  # type: ignore[arg-type]
    return [engine.registry, gateway.registry, worker, registry, scheduler]


def test_dashboards_are_what_the_script_builds() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboards",
                                                  GRAFANA / "build_dashboards.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    for name, board in build.build().items():
        assert (GRAFANA / "dashboards" / name).read_text() == build.render(board), \
            f"run python infra/grafana/build_dashboards.py ({name} is stale)"


def test_vllms_dashboard_metrics_are_all_queried() -> None:
    vllm = {family(m) for e in dashboard_queries()["vllm.json"] for m in METRIC.findall(e)}
    assert VLLM_DASHBOARD_METRICS <= vllm


def test_every_queried_metric_is_exposed() -> None:
    names = set().union(*(exposed(r) for r in shoal_registries()))
    missing = sorted(m for m in queried_metrics() if m not in names)
    assert not missing, f"dashboards query metrics nobody exposes: {missing}"


def test_each_metric_lives_in_one_kind_of_process() -> None:
    """So a Prometheus that scrapes every target counts nothing twice."""
    seen: dict[str, int] = {}
    for i, registry in enumerate(shoal_registries()):
        for metric in registry.collect():
            assert seen.setdefault(metric.name, i) == i, f"{metric.name} is in two processes"


def test_prometheus_and_grafana_are_wired_into_compose() -> None:
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    prom = yaml.safe_load((ROOT / "infra" / "prometheus" / "prometheus.yml").read_text())
    (sd,) = prom["scrape_configs"][0]["http_sd_configs"]
    assert sd["url"] == "http://gateway:8000/metrics/targets"
    mounts = compose["prometheus"]["volumes"] + compose["grafana"]["volumes"]
    for mount in mounts:
        assert (ROOT / mount.split(":")[0]).exists(), mount
    assert compose["registry"]["environment"]["SHOAL_METRICS_HOST"] == "0.0.0.0"
    datasource = yaml.safe_load((GRAFANA / "provisioning" / "datasources" /
                                 "prometheus.yaml").read_text())["datasources"][0]
    assert datasource["url"] == "http://prometheus:9090"


TARGET_LABELS = {"job", "instance"}
"""The labels Prometheus gives every series of a target (its address, the scrape job). A metric
that exposes one of them itself has it renamed `exported_<name>` at scrape time (honor_labels
false, the default), so a panel reading `{{instance}}` shows the target's address instead."""


def sample_labels() -> dict[str, set[str]]:
    """Series name (family and sample names) -> the labels its samples carry."""
    labels: dict[str, set[str]] = {}
    for registry in shoal_registries():
        for metric in registry.collect():
            for sample in metric.samples:
                for name in (metric.name, sample.name):
                    labels.setdefault(name, set()).update(sample.labels)
    return labels


def test_no_metric_exposes_a_label_prometheus_renames() -> None:
    """Issue 24: shoal:instance_pending_info's `instance` became `exported_instance`, and the
    "Pending placements" panel showed the scheduler's address."""
    clashes = {name: sorted(labels & TARGET_LABELS) for name, labels in sample_labels().items()
               if labels & TARGET_LABELS}
    assert not clashes, f"labels Prometheus would rename to exported_*: {clashes}"


def test_every_legend_names_a_label_its_metric_has() -> None:
    labels = sample_labels()
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel["targets"]:
                legend = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", target.get("legendFormat", "")))
                known = set().union(*(labels.get(m, set())
                                      for m in METRIC.findall(target["expr"])))
                missing = legend - known - TARGET_LABELS - {"le"}
                assert not missing, (path.name, panel["title"], sorted(missing))
