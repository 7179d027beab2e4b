"""The autoscaler on simulated load: the HPA rule, the hysteresis band, cool-downs, one-by-one
scale-down after a sustained low, bounds, scale to zero after idling and back on demand."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest

from shoal.services.scheduler.autoscale import Autoscaler, InstanceLoad, band, decide
from shoal.services.scheduler.autoscale_loop import AutoscaleLoop
from shoal.shared.schemas.common import utcnow
from shoal.shared.schemas.infer import EngineLoad
from shoal.shared.schemas.registry import AutoscaleSpec, ScaleEvent
from shoal.shared.schemas.scheduler import ScaleDemand


def spec(**kw: object) -> AutoscaleSpec:
    return AutoscaleSpec(**{"min_replicas": 1, "max_replicas": 4, "target": 2.0,
                            "scale_up_cooldown": 30, "scale_down_cooldown": 60, **kw})


def waiting(*counts: int) -> list[InstanceLoad]:
    return [InstanceLoad(num_running=4, num_waiting=n, kv_cache_usage=0.5) for n in counts]


def simulate(s: AutoscaleSpec, replicas: int, timeline: list[tuple[float, list[InstanceLoad]]],
             demand_at: frozenset[float] = frozenset()) -> list[tuple[float, int, str]]:
    """Run the autoscaler over (time, loads) samples; new instances serve at once here."""
    scaler, out = Autoscaler(), []
    for now, loads in timeline:
        d = scaler.step("m", s, replicas, loads[:replicas], now, demand=now in demand_at)
        if d is not None:
            out.append((now, d.replicas, d.reason))
            replicas = d.replicas
            scaler.scaled("m", now)
    return out


def test_hpa_rule_and_tolerance_band() -> None:
    s = spec()
    assert band(s, waiting(2, 2)) == 0 and band(s, waiting(2, 2, 2, 3)) == 1  # 2.25 > 2.2
    assert band(s, waiting(1, 2)) == -1 and band(s, []) == 0
    assert decide(s, 2, waiting(2, 2), 100, None, None) is None  # at target: nothing
    up = decide(s, 2, waiting(6, 6), 100, None, None)  # 6 per instance: 2 x 3 = 6, max 4
    assert up is not None and up.replicas == 4 and "6.00 waiting requests" in up.reason
    assert decide(s, 2, waiting(3, 2), 100, None, None).replicas == 3  # ceil(2 x 1.25)


def test_cooldowns_and_sustained_low() -> None:
    s = spec()
    assert decide(s, 2, waiting(6, 6), 100, last_scaled_at=80, idle_since=None) is None
    assert decide(s, 2, waiting(6, 6), 100, last_scaled_at=70, idle_since=None) is not None
    low = waiting(0, 0)
    assert decide(s, 3, low, 200, last_scaled_at=100, idle_since=None, low_since=150) is None
    down = decide(s, 3, low, 200, last_scaled_at=100, idle_since=None, low_since=140)
    assert down is not None and down.replicas == 2  # one at a time
    assert decide(s, 1, low, 900, None, None, low_since=0) is None  # min_replicas 1


def test_bounds_are_restored_first() -> None:
    s = spec(min_replicas=2)
    assert decide(s, 1, waiting(0), 0, None, None).replicas == 2
    assert decide(s, 9, waiting(0), 0, None, None).replicas == 4
    with pytest.raises(ValueError):
        spec(min_replicas=5)
    with pytest.raises(ValueError):
        spec(metric="kv_cache_usage", target=1.5)


def test_kv_cache_metric() -> None:
    s = spec(metric="kv_cache_usage", target=0.5)
    loads = [InstanceLoad(1, 0, 0.9), InstanceLoad(1, 0, 0.8)]
    d = decide(s, 2, loads, 0, None, None)
    assert d is not None and d.replicas == 4 and "KV-cache use 85%" in d.reason


def test_a_load_step_and_back_on_simulated_time() -> None:
    """Quiet, then a burst (8 waiting per instance) for two minutes, then quiet again."""
    s = spec()
    timeline = [(t, waiting(*[0] * 4)) for t in range(0, 60, 5)]
    timeline += [(t, waiting(*[8] * 4)) for t in range(60, 180, 5)]
    timeline += [(t, waiting(*[0] * 4)) for t in range(180, 600, 5)]
    events = simulate(s, 1, timeline)
    assert [(t, r) for t, r, _ in events] == [
        (60, 4),                  # the step: ceil(1 x 8 / 2) = 4 (max) at once
        (240, 3), (305, 2), (370, 1)]  # quiet from 180: one down per 60 s of low load, each
    # counted from the sample after the last change (5 s samples)
    assert events[0][2].startswith("scale up") and events[1][2].startswith("scale down")


def test_flapping_load_inside_the_band_changes_nothing() -> None:
    s = spec()
    timeline = [(t, waiting(*([2, 2] if t % 10 else [2, 2.4]))) for t in range(0, 600, 5)]
    assert simulate(s, 2, timeline) == []


def test_scale_to_zero_and_back_on_demand() -> None:
    s = spec(min_replicas=0, scale_to_zero_after=100)
    idle = [InstanceLoad(0, 0, 0.0)]
    timeline = [(t, idle) for t in range(0, 200, 10)] + [(t, []) for t in range(200, 260, 10)]
    events = simulate(s, 1, timeline, demand_at=frozenset({230.0}))
    assert [(t, r) for t, r, _ in events] == [(100, 0), (230, 1)]
    assert "idle for 100 s" in events[0][2] and "scale from zero" in events[1][2]
    # a busy instance never goes to zero, and no demand keeps zero at zero
    assert simulate(s, 1, [(t, waiting(1)) for t in range(0, 400, 10)]) == []
    assert simulate(s, 0, [(t, []) for t in range(0, 400, 10)]) == []


def test_idle_counts_from_the_first_idle_load_not_from_the_start() -> None:
    """An instance that takes longer to start than scale_to_zero_after (no loads until it is
    RUNNING) gets the whole idle window once it serves: it used to be scaled to zero at its
    first load, before anyone could use it (the autoscale e2e test then missed its RUNNING)."""
    s = spec(min_replicas=0, scale_to_zero_after=100)
    idle = [InstanceLoad(0, 0, 0.0)]
    starting = [(t, []) for t in range(0, 150, 10)]
    events = simulate(s, 1, starting + [(t, idle) for t in range(150, 400, 10)])
    assert [(t, r) for t, r, _ in events] == [(250, 0)]
    assert "idle for 100 s" in events[0][2]
    # loads lost for a while (the engine stalled, or a new leader): the window starts again
    gap = [(t, idle) for t in range(0, 60, 10)] + [(t, []) for t in range(60, 90, 10)]
    events = simulate(s, 1, gap + [(t, idle) for t in range(90, 300, 10)])
    assert [(t, r) for t, r, _ in events] == [(190, 0)]


def test_spec_bounds_replicas_and_the_cli_flags() -> None:
    from shoal.cli import build_parser
    from shoal.cli.commands import _autoscaling
    from shoal.shared.schemas.registry import ModelCreate

    args = build_parser().parse_args(["models", "deploy", "m", "--source", "/x", "--autoscale",
                                      "max_replicas=3", "--autoscale", "target=0.5",
                                      "--autoscale", "metric=kv_cache_usage"])
    fields = _autoscaling(args.autoscale)
    assert fields == {"max_replicas": 3, "target": 0.5, "metric": "kv_cache_usage"}
    model = ModelCreate(name="m", source="/x", replicas=7, autoscaling=fields)
    assert model.replicas == 3 and model.autoscaling.min_replicas == 1  # kept within bounds
    with pytest.raises(ValueError):
        ModelCreate(name="m", source="/x", autoscaling={"target": 1})  # max_replicas missing


class _Registry:
    """What the autoscale loop reads and writes, in memory: one autoscaled model with one
    RUNNING instance; `updates` keeps the replica counts written."""

    def __init__(self, model: SimpleNamespace) -> None:
        self.model = model
        self.updates: list[int] = []

    async def list_models(self, _req: object) -> list[SimpleNamespace]:
        return [self.model]

    async def list_instances(self, _req: object) -> list[SimpleNamespace]:
        return [SimpleNamespace(id="i1", model_id="m1")]

    async def update_model(self, req: object) -> None:
        self.updates.append(req.replicas)  # type: ignore[attr-defined]


async def test_a_new_leader_keeps_the_cooldown_of_the_last_scale() -> None:
    """The cool-down runs from the model's last scale event, not from the new leader's start:
    a failover 10 s after a scale-up does not allow another one before scale_up_cooldown."""
    last = ScaleEvent(at=utcnow() - timedelta(seconds=10), from_replicas=1, to_replicas=2,
                      reason="scale up")
    model = SimpleNamespace(id="m1", name="m", version=3, replicas=2, scale_events=[last],
                            autoscaling=spec(max_replicas=8))
    registry, clock = _Registry(model), [1000.0]
    loop = AutoscaleLoop(registry, 1.0, kick=lambda: None,  # type: ignore[arg-type]
                         clock=lambda: clock[0])
    load = EngineLoad(instance_id="i1", model_name="m", num_running=4, num_waiting=12,
                      kv_cache_usage=0.5, max_num_seqs=4, max_model_len=512)
    await loop._on_load(load, None)  # type: ignore[arg-type]
    await loop.step()
    assert registry.updates == []  # 20 s of the 30 s cool-down left
    clock[0] += 21
    await loop._on_load(load, None)  # type: ignore[arg-type]
    await loop.step()
    assert registry.updates == [6]  # ceil(1 x 12 / 2), the cool-down over


async def test_every_cold_start_steps_at_once_on_demand_not_only_the_first() -> None:
    """A demand for a model at zero steps the autoscaler at once (a client waits); a gateway's
    repeats of the same wait do not, and a later cold start does again."""
    model = SimpleNamespace(id="m1", name="m", version=1, replicas=0, scale_events=[],
                            autoscaling=spec(min_replicas=0, max_replicas=2))
    registry, clock = _Registry(model), [1000.0]
    loop = AutoscaleLoop(registry, 1.0, kick=lambda: None,  # type: ignore[arg-type]
                         clock=lambda: clock[0])
    steps: list[float] = []
    step = loop.step

    async def counted() -> None:
        steps.append(clock[0])
        await step()

    loop.step = counted  # type: ignore[method-assign]
    await loop._on_demand(ScaleDemand(model="m"), None)  # type: ignore[arg-type]
    assert steps == [1000.0] and registry.updates == [1]
    clock[0] += 2
    await loop._on_demand(ScaleDemand(model="m"), None)  # type: ignore[arg-type]  # a repeat
    assert steps == [1000.0]
    clock[0] += 600  # scaled to zero since; a new client waits
    await loop._on_demand(ScaleDemand(model="m"), None)  # type: ignore[arg-type]
    assert steps == [1000.0, 1602.0]
