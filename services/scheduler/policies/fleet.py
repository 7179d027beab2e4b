"""FleetIndex: allocatable GPU memory and RAM per worker, kept up to date as instances are placed.

Allocatable = total minus what placed instances claim (not what is in use). The index is built
once from the registry's lists in O(W*G + I) and then updated per placement in O(G + log W):
only the placed worker's numbers and its position in the binpack / spread orders change.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from shoal.shared.schemas.registry import InstancePublic, Placement, WorkerPublic
from shoal.shared.states import PLACED_STATES


@dataclass(slots=True)
class GpuSlot:
    index: int
    name: str
    total: int
    allocated: int = 0

    @property
    def allocatable(self) -> int:
        return max(0, self.total - self.allocated)

    @property
    def claimed_fraction(self) -> float:
        return self.allocated / self.total if self.total else 1.0


@dataclass(slots=True)
class WorkerSlot:
    worker: WorkerPublic
    gpus: list[GpuSlot]
    """Sorted by index."""
    ram_total: int
    ram_allocated: int = 0
    gpu_total: int = 0
    gpu_allocated: int = 0
    max_gpu_allocatable: int = 0
    by_index: dict[int, GpuSlot] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.worker.id

    @property
    def name(self) -> str:
        return self.worker.name

    @property
    def ram_allocatable(self) -> int:
        return max(0, self.ram_total - self.ram_allocated)

    def gpu_fullness(self) -> float:
        return self.gpu_allocated / self.gpu_total if self.gpu_total else 1.0

    def ram_fullness(self) -> float:
        return self.ram_allocated / self.ram_total if self.ram_total else 1.0

    def refresh(self) -> None:
        self.gpu_allocated = sum(g.allocated for g in self.gpus)
        self.max_gpu_allocatable = max((g.allocatable for g in self.gpus), default=0)


def _make_slot(worker: WorkerPublic) -> WorkerSlot:
    gpus = [GpuSlot(g.index, g.name, g.memory_total) for g in sorted(worker.status.gpus,
                                                                     key=lambda g: g.index)]
    slot = WorkerSlot(worker=worker, gpus=gpus, ram_total=worker.status.memory_total,
                      gpu_total=sum(g.total for g in gpus), by_index={g.index: g for g in gpus})
    slot.refresh()
    return slot


class _Order:
    """Workers sorted by (strategy key, name): kept sorted by bisect as their numbers change."""

    def __init__(self, slots: Iterable[WorkerSlot], resource: str, spread: bool) -> None:
        self.resource = resource
        self.sign = 1.0 if spread else -1.0
        self.keys: dict[str, tuple[float, str, str]] = {s.id: self._key(s) for s in slots}
        self.entries = sorted(self.keys.values())

    def _key(self, slot: WorkerSlot) -> tuple[float, str, str]:
        full = slot.gpu_fullness() if self.resource == "gpu" else slot.ram_fullness()
        return (self.sign * full, slot.name, slot.id)

    def update(self, slot: WorkerSlot) -> None:
        if self.resource == "gpu" and not slot.gpus:
            return
        old = self.keys.get(slot.id)
        if old is not None:
            del self.entries[bisect_left(self.entries, old)]
        new = self._key(slot)
        self.keys[slot.id] = new
        insort(self.entries, new)


class FleetIndex:
    """Workers by id and name, their allocations, and their binpack / spread orders."""

    def __init__(self, workers: Iterable[WorkerPublic],
                 instances: Iterable[InstancePublic] = ()) -> None:
        self.workers: list[WorkerSlot] = sorted((_make_slot(w) for w in workers),
                                                key=lambda s: (s.name, s.id))
        self.by_id: dict[str, WorkerSlot] = {s.id: s for s in self.workers}
        self.by_name: dict[str, WorkerSlot] = {s.name: s for s in self.workers}
        self._orders: dict[tuple[str, bool], _Order] = {}
        self.num_releases = 0
        """Bumped whenever a claim is removed: until then a request that did not fit cannot fit."""
        self.max_gpus_per_worker = max((len(s.gpus) for s in self.workers), default=0)
        self.filtered: dict[tuple[object, ...], tuple[list[WorkerSlot], set[str] | None,
                                                      list[str]]] = {}
        """Filter results per request signature: states and labels are fixed in a snapshot."""
        for instance in instances:
            self.account(instance)

    # ------------------------------------------------------------ accounting
    def account(self, instance: InstancePublic, sign: int = 1) -> None:
        """Add (or with sign=-1 remove) what a placed instance claims."""
        if instance.state not in PLACED_STATES or instance.worker_id is None:
            return
        self._claim(instance.worker_id, instance.claim.gpu_memory, instance.claim.ram, sign)
        for sub in instance.subordinate_workers:
            self._claim(sub.worker_id, sub.claim.gpu_memory, sub.claim.ram, sign)

    def apply(self, placement: Placement, sign: int = 1) -> None:
        """Record a placement just made (so the next placement sees it)."""
        self._claim(placement.worker_id, placement.claim.gpu_memory, placement.claim.ram, sign)
        for sub in placement.subordinate_workers:
            self._claim(sub.worker_id, sub.claim.gpu_memory, sub.claim.ram, sign)

    def _claim(self, worker_id: str, gpu_memory: dict[int, int], ram: int, sign: int) -> None:
        slot = self.by_id.get(worker_id)
        if slot is None:
            return  # a deleted worker: nothing of ours to account
        if sign < 0:
            self.num_releases += 1
        for index, num_bytes in gpu_memory.items():
            gpu = slot.by_index.get(index)
            if gpu is not None:
                gpu.allocated = max(0, gpu.allocated + sign * num_bytes)
        slot.ram_allocated = max(0, slot.ram_allocated + sign * ram)
        slot.refresh()
        for order in self._orders.values():
            order.update(slot)

    # ------------------------------------------------------------ orders
    def ordered(self, resource: str, spread: bool) -> Iterator[WorkerSlot]:
        """Workers fullest first (binpack) or emptiest first (spread), then by name.

        resource 'gpu' orders by claimed GPU memory (workers without GPUs never appear); 'ram' by
        claimed RAM. The order is built on first use and then maintained in O(log W) per change.
        """
        order = self._orders.get((resource, spread))
        if order is None:
            pool = [s for s in self.workers if s.gpus] if resource == "gpu" else self.workers
            order = self._orders[(resource, spread)] = _Order(pool, resource, spread)
        by_id = self.by_id
        for _, _, worker_id in order.entries:
            yield by_id[worker_id]
