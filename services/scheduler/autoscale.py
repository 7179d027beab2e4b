"""The autoscaler's decision for one model, from the loads its engines publish: pure, so it is
tested on simulated load without a network.

Kubernetes' HPA rule with hysteresis: desired = ceil(ready x metric / target), applied only when
the metric leaves the band target x (1 +- tolerance). Up at once to the desired count (after
`scale_up_cooldown` since the last change); down one replica at a time, after
`scale_down_cooldown` since the last change. With min_replicas 0 a model idle for
`scale_to_zero_after` seconds goes to zero, and a request's demand brings it back to one at once;
idle counts from the first load of a RUNNING instance saying nothing runs or waits, never from
while its instances start.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.shared.schemas.registry import AutoscaleSpec


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """The last load of one RUNNING instance (EngineLoad's fields that matter here)."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float


@dataclass(frozen=True, slots=True)
class Decision:
    replicas: int
    reason: str


def metric_value(spec: AutoscaleSpec, loads: Sequence[InstanceLoad]) -> float:
    if spec.metric == "kv_cache_usage":
        return sum(x.kv_cache_usage for x in loads) / len(loads)
    return sum(x.num_waiting for x in loads) / len(loads)


def _describe(spec: AutoscaleSpec, value: float) -> str:
    if spec.metric == "kv_cache_usage":
        return f"KV-cache use {value:.0%} per instance (target {spec.target:.0%})"
    return f"{value:.2f} waiting requests per instance (target {spec.target:g})"


def band(spec: AutoscaleSpec, loads: Sequence[InstanceLoad]) -> int:
    """+1 above the tolerance band, -1 below it, 0 within (or no data)."""
    if not loads:
        return 0
    ratio = metric_value(spec, loads) / spec.target
    return 1 if ratio > 1 + spec.tolerance else -1 if ratio < 1 - spec.tolerance else 0


def decide(spec: AutoscaleSpec, replicas: int, loads: Sequence[InstanceLoad], now: float,
           last_scaled_at: float | None, idle_since: float | None, low_since: float | None = None,
           demand: bool = False) -> Decision | None:
    """The new replica count and why, or None to keep `replicas`.

    loads: fresh loads of the model's RUNNING instances; idle_since: since when their loads
    have said that nothing runs or waits on any of them (None: busy now, or no loads yet);
    low_since: since when the metric has stayed below
    the band (None: it is not); demand: a gateway holds a request for the model while it has
    no instance."""
    since = math.inf if last_scaled_at is None else now - last_scaled_at
    low_for = 0.0 if low_since is None else now - low_since
    if replicas < spec.min_replicas:
        return Decision(spec.min_replicas, f"below min_replicas {spec.min_replicas}")
    if replicas > spec.max_replicas:
        return Decision(spec.max_replicas, f"above max_replicas {spec.max_replicas}")
    if replicas == 0:
        if demand:
            return Decision(1, "scale from zero: a request is waiting for the model")
        return None
    if not loads:
        return None  # instances still starting: no data to act on
    if (spec.min_replicas == 0 and idle_since is not None
            and now - idle_since >= spec.scale_to_zero_after and not demand):
        return Decision(0, f"scale to zero: idle for {now - idle_since:.0f} s "
                           f"(scale_to_zero_after {spec.scale_to_zero_after:g} s)")
    value = metric_value(spec, loads)
    ratio = value / spec.target
    if ratio > 1 + spec.tolerance:
        desired = min(spec.max_replicas, math.ceil(len(loads) * ratio))
        if desired > replicas and since >= spec.scale_up_cooldown:
            return Decision(desired, f"scale up: {_describe(spec, value)} over "
                                     f"{len(loads)} running instance(s)")
    elif ratio < 1 - spec.tolerance and replicas > max(1, spec.min_replicas):
        desired = max(spec.min_replicas, 1, math.ceil(len(loads) * ratio))
        if (desired < replicas and since >= spec.scale_down_cooldown
                and low_for >= spec.scale_down_cooldown):
            return Decision(replicas - 1, f"scale down: {_describe(spec, value)} over "
                                          f"{len(loads)} running instance(s)")
    return None


class Autoscaler:
    """decide() over time for every autoscaled model: remembers when each last scaled, since
    when it has been idle and since when below its band. One scheduler leader holds it; a new
    leader takes each model's last scale time from the scale events the registry keeps
    (`resume`), so a failover does not cut a cool-down short; the idle and below-band windows it
    observes afresh (a failover can only delay a scale-down, never hasten one)."""

    def __init__(self) -> None:
        self.last_scaled_at: dict[str, float] = {}
        self.idle_since: dict[str, float] = {}
        self.low_since: dict[str, float] = {}

    def step(self, model: str, spec: AutoscaleSpec, replicas: int,
             loads: Sequence[InstanceLoad], now: float, demand: bool = False) -> Decision | None:
        busy = demand or any(x.num_running or x.num_waiting for x in loads)
        # Idle is something observed: a RUNNING instance's load saying nothing runs or waits.
        # No loads (instances still starting) is no observation, so the window opens at the
        # first idle load: an instance that took longer than scale_to_zero_after to start is
        # not scaled away the moment it is RUNNING, before anyone could use it.
        if busy or replicas == 0 or not loads:
            self.idle_since.pop(model, None)
        else:
            self.idle_since.setdefault(model, now)
        if band(spec, loads) < 0:
            self.low_since.setdefault(model, now)
        else:
            self.low_since.pop(model, None)
        return decide(spec, replicas, loads, now, self.last_scaled_at.get(model),
                      self.idle_since.get(model), self.low_since.get(model), demand)

    def resume(self, model: str, seconds_ago: float, now: float) -> None:
        """The model last scaled `seconds_ago` (its last scale event), unless this scaler knows
        better (it scaled the model itself)."""
        self.last_scaled_at.setdefault(model, now - max(0.0, seconds_ago))

    def scaled(self, model: str, now: float) -> None:
        """Called once a decision is written (a failed write is retried at the next step)."""
        self.last_scaled_at[model] = now
        self.low_since.pop(model, None)
        self.idle_since.pop(model, None)

    def forget(self, keep: set[str]) -> None:
        for table in (self.last_scaled_at, self.idle_since, self.low_since):
            for name in set(table) - keep:
                del table[name]
