"""One reconcile pass decided from the registry's lists: replicas, rescheduling, double claims."""

from __future__ import annotations

from datetime import timedelta

from tests.unit.scheduler.sched_fleet import GIB, NOW, claimed_gpu, worker

from shoal.services.scheduler.reconcile import SchedulerConfig, plan_pass
from shoal.shared.schemas.registry import ModelPublic, ResourceClaim
from shoal.shared.states import InstanceState

CONFIG = SchedulerConfig(reschedule_after=300, error_backoff=10, error_backoff_max=60)


def model(mid: str, replicas: int) -> ModelPublic:
    return ModelPublic(id=mid, name=mid, source="/m", replicas=replicas, created_at=NOW,
                       updated_at=NOW, version=1)


def inst(mid: str, state: InstanceState, age_s: float = 0, created_s: float = 0, **kw: object):
    i = claimed_gpu("wid-a", 0, GIB, state=state)
    return i.model_copy(update={"model_id": mid, "state_changed_at": NOW - timedelta(seconds=age_s),
                                "created_at": NOW + timedelta(seconds=created_s), **kw})


def test_replicas_are_created_and_extras_deleted_idle_first() -> None:
    running = inst("m2", InstanceState.RUNNING, created_s=1)
    pending = inst("m2", InstanceState.PENDING, created_s=0)
    newer = inst("m2", InstanceState.RUNNING, created_s=5)
    plan = plan_pass([model("m1", 2), model("m2", 1)], [worker("a", 1)],
                     [running, pending, newer], NOW, CONFIG)
    assert [m.id for m in plan.create] == ["m1", "m1"]
    assert plan.delete == [pending, newer]  # PENDING first, then the newest RUNNING
    assert plan.pending == []


def test_unreachable_rescheduled_after_grace_period() -> None:
    fresh = inst("m", InstanceState.UNREACHABLE, age_s=100, worker_name="a")
    stale = inst("m", InstanceState.UNREACHABLE, age_s=301, worker_name="a",
                 state_message="worker a stopped heartbeating")  # as the registry words it
    plan = plan_pass([model("m", 2)], [worker("a", 1)], [fresh, stale], NOW, CONFIG)
    assert [u.instance for u in plan.unschedule] == [stale]
    assert "worker a stopped heartbeating" in plan.unschedule[0].message


def test_error_backoff_doubles_and_caps() -> None:
    assert [CONFIG.backoff(n) for n in range(5)] == [10, 20, 40, 60, 60]
    early = inst("m", InstanceState.ERROR, age_s=15, restart_count=1, state_message="oom")
    due = inst("m", InstanceState.ERROR, age_s=25, restart_count=1, state_message="oom")
    plan = plan_pass([model("m", 2)], [worker("a", 1)], [early, due], NOW, CONFIG)
    assert [u.instance for u in plan.unschedule] == [due]
    assert plan.unschedule[0].restart_count == 2 and "oom" in plan.unschedule[0].message


def test_an_instance_that_keeps_failing_is_placed_afresh() -> None:
    # the worker restarts crashed engines in place; at 5, 10... failures the scheduler moves it
    fifth = inst("m", InstanceState.ERROR, age_s=1, restart_count=5, worker_name="a")
    sixth = inst("m", InstanceState.ERROR, age_s=1, restart_count=6, worker_name="a")
    plan = plan_pass([model("m", 2)], [worker("a", 1)], [fifth, sixth], NOW, CONFIG)
    assert [u.instance for u in plan.unschedule] == [fifth]
    assert "failed 5 times on worker a" in plan.unschedule[0].message
    assert plan.unschedule[0].restart_count is None  # the count goes on (and so the back-off)


def test_removed_worker_and_pending_order() -> None:
    orphan = inst("m", InstanceState.RUNNING, worker_id="wid-gone", worker_name="gone")
    p2 = inst("m", InstanceState.PENDING, created_s=2)
    p1 = inst("m", InstanceState.PENDING, created_s=1)
    plan = plan_pass([model("m", 3)], [worker("a", 1)], [orphan, p2, p1], NOW, CONFIG)
    assert [u.instance for u in plan.unschedule] == [orphan]
    assert plan.pending == [p1, p2]


def test_a_gpu_claimed_twice_sends_the_newest_back() -> None:
    first = inst("m", InstanceState.RUNNING, age_s=50)
    first = first.model_copy(update={"claim": ResourceClaim(gpu_memory={0: 72 * GIB})})
    racer = inst("m", InstanceState.SCHEDULED, age_s=1)
    racer = racer.model_copy(update={"claim": ResourceClaim(gpu_memory={0: 72 * GIB})})
    plan = plan_pass([model("m", 2)], [worker("a", 1)], [first, racer], NOW, CONFIG)
    assert [u.instance.id for u in plan.unschedule] == [racer.id]
    assert "claimed by two placements at once" in plan.unschedule[0].message


def test_a_manual_overcommit_is_left_alone() -> None:
    first = inst("m", InstanceState.SCHEDULED, age_s=50)
    first = first.model_copy(update={"claim": ResourceClaim(gpu_memory={0: 72 * GIB})})
    manual = inst("m", InstanceState.SCHEDULED, age_s=1, warnings=["Overcommit: a GPU 0 ..."])
    manual = manual.model_copy(update={"claim": ResourceClaim(gpu_memory={0: 72 * GIB})})
    plan = plan_pass([model("m", 2)], [worker("a", 1)], [first, manual], NOW, CONFIG)
    assert plan.unschedule == []


def test_a_changed_model_rolls_its_instances_one_at_a_time() -> None:
    """After an update of how the model runs (run_revision 1), its instances of revision 0 are
    replaced: one new starts while the old serve, an old goes when a new is RUNNING."""
    changed = model("m", 2).model_copy(update={"run_revision": 1})
    run, pend = InstanceState.RUNNING, InstanceState.PENDING
    a, b = inst("m", run, created_s=0), inst("m", run, created_s=1)

    def step(*instances):
        plan = plan_pass([changed], [worker("a", 1)], list(instances), NOW, CONFIG)
        return len(plan.create), plan.delete

    assert step(a, b) == (1, [])  # one new instance, both old serve
    c = inst("m", pend, created_s=2, run_revision=1)
    assert step(a, b, c) == (0, [])  # it starts: nothing more
    c = c.model_copy(update={"state": run})
    assert step(a, b, c) == (1, [a])  # it serves: the oldest goes, the next new one starts
    d = inst("m", run, created_s=3, run_revision=1)
    assert step(b, c, d) == (0, [b])
    assert step(c, d) == (0, [])  # rolled: the usual counting again
    failed = inst("m", InstanceState.ERROR, created_s=2, run_revision=1)
    assert step(a, b, failed) == (0, [])  # a failing new one holds the roll; the old serve


def test_old_instances_that_serve_nothing_go_at_once() -> None:
    changed = model("m", 1).model_copy(update={"run_revision": 2})
    broken = inst("m", InstanceState.ERROR, run_revision=1)
    plan = plan_pass([changed], [worker("a", 1)], [broken], NOW, CONFIG)
    assert len(plan.create) == 1 and plan.delete == [broken]
    assert plan.unschedule == []  # not also rescheduled
    gone = model("m", 0).model_copy(update={"run_revision": 1})
    serving = inst("m", InstanceState.RUNNING)
    assert plan_pass([gone], [worker("a", 1)], [serving], NOW, CONFIG).delete == [serving]
