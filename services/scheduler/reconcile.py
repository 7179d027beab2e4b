"""What one reconcile pass must do, decided from the registry's lists: pure, so unit-tested.

Replica counts (create / delete), the roll of instances made before the model's run settings
changed (one at a time), rescheduling (UNREACHABLE past the grace period, ERROR after an
exponential back-off, instances on removed workers, GPUs claimed twice by racing schedulers) and
the PENDING instances to place, oldest first. The service executes the plan through the registry.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from datetime import datetime

from shoal.shared.config import Settings
from shoal.shared.schemas.registry import InstancePublic, ModelPublic, WorkerPublic
from shoal.shared.states import PLACED_STATES, InstanceState

_S = InstanceState
DELETE_FIRST = {_S.PENDING: 0, _S.ERROR: 1, _S.UNREACHABLE: 2, _S.SCHEDULED: 3,
                _S.DOWNLOADING: 4, _S.STARTING: 5, _S.RUNNING: 6}
"""When a model has too many instances, those that serve nothing go first."""


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    interval: float = 5.0
    """Seconds between periodic reconciles (events trigger one sooner)."""
    reschedule_after: float = 300.0
    """Seconds an instance stays UNREACHABLE before it is placed elsewhere (GPUStack: 300 s)."""
    error_backoff: float = 10.0
    """First wait before an ERROR instance is rescheduled; doubles with each attempt."""
    error_backoff_max: float = 600.0
    max_local_restarts: int = 5
    """An instance that failed this many times more (the worker restarts crashed engines in place,
    with its own back-off) is placed afresh, maybe elsewhere: at 5, 10, 15... failures."""
    debounce: float = 0.05
    """Seconds to gather a burst of events into one reconcile."""
    durable: str = "shoal-scheduler"
    """JetStream durable consumer name, shared by every scheduler replica."""
    autoscale_interval: float = 2.0
    """Seconds between the leader's autoscaling steps (autoscale_loop.py)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> SchedulerConfig:
        """Built at the entry point from SHOAL_SCHEDULER_* / SHOAL_RESCHEDULE_AFTER."""
        return cls(interval=settings.scheduler_interval, reschedule_after=settings.reschedule_after,
                   error_backoff=settings.scheduler_error_backoff,
                   error_backoff_max=settings.scheduler_error_backoff_max,
                   autoscale_interval=settings.scheduler_autoscale_interval)

    def backoff(self, restart_count: int) -> float:
        return min(self.error_backoff * 2.0 ** min(restart_count, 30), self.error_backoff_max)


@dataclass(slots=True)
class Unschedule:
    instance: InstancePublic
    message: str
    restart_count: int | None = None


@dataclass(slots=True)
class PassPlan:
    create: list[ModelPublic] = field(default_factory=list)
    """One entry per instance to create."""
    delete: list[InstancePublic] = field(default_factory=list)
    unschedule: list[Unschedule] = field(default_factory=list)
    pending: list[InstancePublic] = field(default_factory=list)
    """PENDING instances to place, oldest first."""


def _age(instance: InstancePublic, now: datetime) -> float:
    return (now - instance.state_changed_at).total_seconds()


def scale(model: ModelPublic, mine: list[InstancePublic]) -> tuple[int, list[InstancePublic]]:
    """Instances to create and to delete for the model's replica count; those that serve
    nothing go first, then the newest."""
    if len(mine) <= model.replicas:
        return model.replicas - len(mine), []
    ranked = sorted(mine, key=lambda i: (DELETE_FIRST[i.state], -i.created_at.timestamp(), i.id))
    return 0, ranked[: len(mine) - model.replicas]


def roll(model: ModelPublic, mine: list[InstancePublic]) -> tuple[int, list[InstancePublic]]:
    """Replace the instances made before the model's run settings last changed (an older
    run_revision), one at a time: a new one starts while the old ones serve, and an old one
    goes once a new one is RUNNING. Old ones that serve nothing go at once; a new one that
    fails holds the roll (the old ones keep serving) while the usual back-off retries it."""
    old = sorted((i for i in mine if i.run_revision < model.run_revision),
                 key=lambda i: (i.created_at, i.id))
    serving = [i for i in old if i.state is _S.RUNNING]
    create, delete = scale(model, [i for i in mine if i.run_revision >= model.run_revision])
    current = [i for i in mine if i.run_revision >= model.run_revision and i not in delete]
    ready = sum(1 for i in current if i.state is _S.RUNNING)
    if create:  # the old serving ones stand in for what is missing, but one new starts at once
        starting = len(current) > ready
        create = max(create - len(serving), 0 if starting else 1)
    excess = max(0, min(ready + len(serving) - model.replicas, len(serving)))
    return create, [i for i in old if i.state is not _S.RUNNING] + serving[:excess] + delete


def plan_pass(models: list[ModelPublic], workers: list[WorkerPublic],
              instances: list[InstancePublic], now: datetime, config: SchedulerConfig) -> PassPlan:
    plan = PassPlan()
    by_model: dict[str, list[InstancePublic]] = defaultdict(list)
    for inst in instances:
        by_model[inst.model_id].append(inst)
    gone: set[str] = set()
    for model in sorted(models, key=lambda m: (m.created_at, m.id)):
        mine = by_model.get(model.id, [])
        create, extra = (roll(model, mine) if any(i.run_revision < model.run_revision
                                                   for i in mine) else scale(model, mine))
        plan.create += [model] * create
        plan.delete += extra
        gone |= {i.id for i in extra}
    known_models = {m.id for m in models}
    worker_ids = {w.id for w in workers}
    for inst in instances:
        if inst.id in gone or inst.model_id not in known_models:
            continue
        if inst.state is _S.UNREACHABLE and _age(inst, now) >= config.reschedule_after:
            why = inst.state_message or f"worker {inst.worker_name} is not ready"
            plan.unschedule.append(Unschedule(inst, (
                f"Rescheduled: {why}, and the instance was unreachable for "
                f"{_age(inst, now):.0f} s (reschedule_after {config.reschedule_after:g} s).")))
        elif inst.state is _S.ERROR and _age(inst, now) >= config.backoff(inst.restart_count):
            plan.unschedule.append(Unschedule(inst, (
                f"Rescheduled: in ERROR for {_age(inst, now):.0f} s without a restart (back-off "
                f"{config.backoff(inst.restart_count):g} s after {inst.restart_count} failures): "
                f"{inst.state_message or 'no message'}"), restart_count=inst.restart_count + 1))
        elif (inst.state is _S.ERROR and inst.restart_count > 0
              and inst.restart_count % config.max_local_restarts == 0):
            plan.unschedule.append(Unschedule(inst, (
                f"Rescheduled: failed {inst.restart_count} times on worker {inst.worker_name}: "
                f"{inst.state_message or 'no message'}")))
        elif inst.state in PLACED_STATES and inst.worker_id and inst.worker_id not in worker_ids:
            plan.unschedule.append(Unschedule(inst, (
                f"Rescheduled: worker {inst.worker_name} was removed from the registry.")))
        elif inst.state is _S.PENDING:
            plan.pending.append(inst)
    taken = {u.instance.id for u in plan.unschedule}
    for inst, message in double_claims(workers, instances):
        if inst.id not in taken and inst.id not in gone:
            plan.unschedule.append(Unschedule(inst, message))
            taken.add(inst.id)
    plan.pending.sort(key=lambda i: (i.created_at, i.id))
    return plan


def double_claims(workers: list[WorkerPublic], instances: list[InstancePublic]
                  ) -> list[tuple[InstancePublic, str]]:
    """Instances to unschedule because their GPU is claimed past its size.

    Two schedulers placing different instances at once can both pick one GPU (each write is
    valid on its own row). The newest placement that has not started yet goes back to PENDING;
    a GPU a user overcommitted on purpose (a placement with warnings) is left as chosen.
    """
    totals = {(w.id, g.index): g.memory_total for w in workers for g in w.status.gpus}
    names = {w.id: w.name for w in workers}
    users: dict[tuple[str, int], list[tuple[InstancePublic, int]]] = defaultdict(list)
    for inst in instances:
        if inst.state not in PLACED_STATES or inst.worker_id is None:
            continue
        parts = [(inst.worker_id, inst.claim.gpu_memory)]
        parts += [(s.worker_id, s.claim.gpu_memory) for s in inst.subordinate_workers]
        for worker_id, gpu_memory in parts:
            for index, num_bytes in gpu_memory.items():
                users[(worker_id, index)].append((inst, num_bytes))
    out: list[tuple[InstancePublic, str]] = []
    chosen: set[str] = set()
    for (worker_id, index), claims in sorted(users.items()):
        total = totals.get((worker_id, index))
        used = sum(b for _, b in claims)
        if total is None or used <= total or any(i.warnings for i, _ in claims):
            continue  # fits, or a user overcommitted it on purpose (manual selection)
        movable = [(i, b) for i, b in claims if i.state in (
            _S.SCHEDULED, _S.DOWNLOADING) and i.id not in chosen]
        movable.sort(key=lambda ib: (ib[0].state_changed_at, ib[0].id), reverse=True)
        for inst, num_bytes in movable:
            if used <= total:
                break
            used -= num_bytes
            chosen.add(inst.id)
            out.append((inst, f"Rescheduled: GPU {index} of worker {names.get(worker_id)} was "
                              "claimed by two placements at once (concurrent schedulers)."))
    return out
