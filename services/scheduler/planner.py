"""Entry points of the pure policy: `Planner` (the service's incremental placer, and the dry run's,
services/scheduler/dry_run.py) and `plan_placement`, one placement on a fleet snapshot.

`plan_placement(model, workers, instances)` reads the model's files (headers only), builds the
fleet index and returns a PlacementResult; what the model can never run is an InvalidRequest.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from shoal.services.scheduler.claim import (
    ModelProfile, check_runnable, compute_claim, read_profile
)
from shoal.services.scheduler.claim.model_claim import device_kinds
from shoal.services.scheduler.policies.base import PlacementRequest
from shoal.services.scheduler.policies.fleet import FleetIndex
from shoal.services.scheduler.policies.pipeline import PlacementResult, SchedulingPipeline
from shoal.shared.schemas.registry import InstancePublic, ModelSpec, WorkerPublic


def build_request(model: ModelSpec, profile: ModelProfile) -> PlacementRequest:
    """The claims of one instance of `model`; InvalidRequest naming the field when the model can
    never run as specified (claim/runnable.py)."""
    check_runnable(model, profile)
    kinds = device_kinds(model)
    return PlacementRequest(
        model=model,
        gpu_claim=compute_claim(profile, model, "gpu") if "gpu" in kinds else None,
        cpu_claim=compute_claim(profile, model, "cpu") if "cpu" in kinds else None,
        model_name=getattr(model, "name", "the model"),
    )


class ProfileCache:
    """Profiles by (path, size, mtime): a GGUF header takes seconds to parse, so parse it once."""

    def __init__(self) -> None:
        self._profiles: dict[tuple[str, int, int], ModelProfile] = {}

    def get(self, source: str) -> ModelProfile:
        path = Path(source).expanduser()
        try:
            stat = os.stat(path / "config.json" if path.is_dir() else path)
            key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        except OSError:
            return read_profile(path)  # raises NotFound with a clear message
        profile = self._profiles.get(key)
        if profile is None:
            profile = self._profiles[key] = read_profile(path)
        return profile


class Planner:
    """One fleet snapshot, placed into incrementally: place() then commit() what was accepted."""

    def __init__(self, workers: Iterable[WorkerPublic], instances: Iterable[InstancePublic] = (),
                 profiles: ProfileCache | None = None,
                 pipeline: SchedulingPipeline | None = None) -> None:
        self.index = FleetIndex(workers, instances)
        self.profiles = profiles or ProfileCache()
        self.pipeline = pipeline or SchedulingPipeline()
        self._misses: dict[str, tuple[int, PlacementResult]] = {}
        """Requests that did not fit, by model spec: claims only grow between releases, so the
        same request cannot fit until something is released (saves the O(W*G) explanation)."""

    def place(self, model: ModelSpec, profile: ModelProfile | None = None) -> PlacementResult:
        request = build_request(model, profile or self.profiles.get(model.source))
        return self.place_request(request)

    def place_request(self, request: PlacementRequest) -> PlacementResult:
        key = request.model.model_dump_json()
        miss = self._misses.get(key)
        if miss is not None and miss[0] == self.index.num_releases:
            return miss[1]
        result = self.pipeline.place(self.index, request)
        if not result.ok:
            self._misses[key] = (self.index.num_releases, result)
        return result

    def commit(self, result: PlacementResult) -> None:
        """Count an accepted placement, so the next decision sees it."""
        if result.placement is not None:
            self.index.apply(result.placement)


def plan_placement(model: ModelSpec, workers: Iterable[WorkerPublic],
                   instances: Iterable[InstancePublic] = (), *,
                   profile: ModelProfile | None = None) -> PlacementResult:
    """Where one more instance of `model` would go now, or why it cannot (nothing is written).

    `result.placement` is a Placement or None; `result.describe()` is the text to print.
    """
    return Planner(workers, instances).place(model, profile)
