"""A worker's metrics: its machine's devices as its last heartbeat reported them (CPU cores,
RAM, and each GPU's memory and utilisation), labelled by worker; each device belongs to one
worker, so sums over workers add up."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from shoal.shared.schemas.registry import DeviceStatus


def _gauge(name: str, doc: str, labels: list[str],
           samples: list[tuple[list[str], float]]) -> GaugeMetricFamily:
    gauge = GaugeMetricFamily(name, doc, labels=labels)
    for values, value in samples:
        gauge.add_metric(values, value)
    return gauge


class DeviceCollector(Collector):
    def __init__(self, worker: str, status: Callable[[], DeviceStatus | None]) -> None:
        self.worker = worker
        self.status = status

    def collect(self) -> Iterator[Metric]:
        s = self.status()
        if s is None:
            return
        w = ["worker"]
        yield _gauge("shoal:worker_cpu_cores", "CPU cores.", w, [([self.worker], s.cpu_cores)])
        yield _gauge("shoal:worker_memory_total_bytes", "RAM.", w,
                     [([self.worker], s.memory_total)])
        yield _gauge("shoal:worker_memory_used_bytes", "RAM in use.", w,
                     [([self.worker], s.memory_used)])
        g = ["worker", "gpu", "name"]
        gpus = [([self.worker, str(d.index), d.name], d) for d in s.gpus]
        yield _gauge("shoal:gpu_memory_total_bytes", "GPU memory.", g,
                     [(v, d.memory_total) for v, d in gpus])
        yield _gauge("shoal:gpu_memory_used_bytes", "GPU memory in use.", g,
                     [(v, d.memory_used) for v, d in gpus])
        yield _gauge("shoal:gpu_utilization", "GPU utilisation, 0..1.", g,
                     [(v, d.utilization / 100) for v, d in gpus if d.utilization is not None])
