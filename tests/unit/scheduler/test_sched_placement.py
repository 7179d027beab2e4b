"""Placement rules on synthetic fleets: one GPU, several GPUs, several workers, CPU, policies."""

from __future__ import annotations

import random

import pytest
from tests.unit.scheduler.sched_fleet import GIB, claimed_gpu, placed, profile, spec, worker

from shoal.services.scheduler.planner import Planner, plan_placement
from shoal.shared.errors import InvalidRequest
from shoal.shared.states import WorkerState

SMALL = profile(7)  # ~14.3 GiB in bf16: one GPU
BIG = profile(70, layers=80, heads=64, kv_heads=8, hidden=8192)  # ~131 GiB: two 80 GB GPUs
NINE = profile(70, layers=30, heads=9, kv_heads=3, hidden=576 * 8)  # SmolLM2's head counts


def test_single_gpu_binpack_takes_the_fullest_worker() -> None:
    fleet = [worker("a", 2), worker("b", 2), worker("c", 2)]
    instances = [claimed_gpu("wid-b", 0, int(72 * GIB))]
    r = plan_placement(spec(), fleet, instances, profile=SMALL)
    assert r.ok and r.placement.worker_id == "wid-b" and r.placement.gpu_indexes == [1]
    assert (r.placement.tp, r.placement.pp) == (1, 1)
    # an LLM instance claims gpu_memory_utilization of the GPU, as vLLM takes it
    assert r.placement.claim.gpu_memory == {1: int(80 * GIB * 0.9)}


def test_spread_takes_the_emptiest_worker() -> None:
    fleet = [worker("a", 2), worker("b", 2), worker("c", 2)]
    instances = [claimed_gpu("wid-a", 0, int(72 * GIB)), claimed_gpu("wid-c", 0, int(72 * GIB))]
    r = plan_placement(spec(placement_strategy="spread"), fleet, instances, profile=SMALL)
    assert r.placement.worker_id == "wid-b" and r.placement.gpu_indexes == [0]


def test_deterministic_whatever_the_input_order() -> None:
    fleet = [worker(f"w{i:02d}", 4) for i in range(20)]
    answers = set()
    for seed in range(5):
        shuffled = fleet[:]
        random.Random(seed).shuffle(shuffled)
        r = plan_placement(spec(), shuffled, [], profile=SMALL)
        answers.add((r.placement.worker_id, tuple(r.placement.gpu_indexes)))
    assert answers == {("wid-w00", (0,))}


def test_partially_claimed_gpus_below_the_threshold_are_skipped() -> None:
    # GPU 0 is 20% claimed: 80% unclaimed < the 90% an instance takes, so GPU 1 is chosen
    fleet = [worker("a", 2)]
    instances = [claimed_gpu("wid-a", 0, int(16 * GIB))]
    r = plan_placement(spec(), fleet, instances, profile=SMALL)
    assert r.placement.gpu_indexes == [1]
    # at gpu_memory_utilization 0.5 the same GPU qualifies again (and binpack prefers it)
    r = plan_placement(spec(gpu_memory_utilization=0.5), fleet, instances, profile=SMALL)
    assert r.placement.gpu_indexes == [0] and r.placement.claim.gpu_memory == {0: 40 * GIB}


def test_multi_gpu_fewest_that_fit() -> None:
    r = plan_placement(spec(), [worker("a", 8)], [], profile=BIG)
    assert r.ok and (r.placement.tp, r.placement.pp) == (2, 1)
    assert r.placement.gpu_indexes == [0, 1] and r.candidate.selector == "multi-GPU on one worker"


def test_nine_heads_never_get_tp2() -> None:
    # fits on 2 GPUs by memory, but TP must divide 9 heads and 3 KV heads: TP=3
    r = plan_placement(spec(), [worker("a", 4)], [], profile=NINE)
    assert r.ok and r.placement.tp == 3 and len(r.placement.gpu_indexes) == 3
    # a fleet of one 2-GPU worker cannot take it at all
    r = plan_placement(spec(), [worker("a", 2)], [], profile=NINE)
    assert not r.ok and "9 attention heads and 3 KV heads" in r.reason
    assert "TP=2" not in r.reason


def test_multi_worker_even_split_tp_within_pp_across() -> None:
    fleet = [worker("a", 1), worker("b", 1), worker("c", 2, gpu_gib=40)]
    r = plan_placement(spec(), fleet, [], profile=BIG)
    # two workers x 1 GPU of 80 GB: TP=1, PP=2
    assert r.ok and (r.placement.tp, r.placement.pp) == (1, 2)
    assert r.placement.worker_id == "wid-a"
    assert [s.worker_name for s in r.placement.subordinate_workers] == ["b"]
    fleet = [worker("a", 2, gpu_gib=40), worker("b", 2, gpu_gib=40)]
    r = plan_placement(spec(), fleet, [], profile=BIG)
    assert (r.placement.tp, r.placement.pp) == (2, 2) and r.placement.gpu_indexes == [0, 1]
    sub = r.placement.subordinate_workers[0]
    assert sub.gpu_indexes == [0, 1] and sub.claim.gpu_memory == {0: 36 * GIB, 1: 36 * GIB}


def test_uneven_workers_fall_back_to_tp1_pp_all() -> None:
    # 3 GPUs needed; a has 2, b has 1: no even split, so TP=1 and PP=3
    fleet = [worker("a", 2, gpu_gib=60), worker("b", 1, gpu_gib=60)]
    r = plan_placement(spec(), fleet, [], profile=BIG)
    assert r.ok and (r.placement.tp, r.placement.pp) == (1, 3)
    assert r.placement.gpu_indexes == [0, 1]
    assert r.placement.subordinate_workers[0].gpu_indexes == [0]


def test_distributed_false_keeps_one_worker() -> None:
    fleet = [worker("a", 1), worker("b", 1)]
    r = plan_placement(spec(distributed=False), fleet, [], profile=BIG)
    assert not r.ok and "distributed=false" in r.reason


def test_explicit_tp_pp_fix_the_gpu_count() -> None:
    r = plan_placement(spec(tp=4), [worker("a", 8)], [], profile=SMALL)
    assert (r.placement.tp, r.placement.pp, len(r.placement.gpu_indexes)) == (4, 1, 4)
    fleet = [worker("a", 2), worker("b", 2)]
    r = plan_placement(spec(tp=2, pp=2), fleet, [], profile=SMALL)
    assert (r.placement.tp, r.placement.pp) == (2, 2) and len(r.placement.subordinate_workers) == 1
    with pytest.raises(InvalidRequest) as refused:  # never, on any fleet: refused, not PENDING
        plan_placement(spec(tp=2), [worker("a", 4)], [], profile=NINE)
    assert refused.value.param == "tp" and "tp=2 cannot work" in refused.value.message


def test_manual_selection_and_overcommit_warning() -> None:
    fleet = [worker("a", 2), worker("b", 2)]
    full = [claimed_gpu("wid-b", 1, int(72 * GIB))]
    r = plan_placement(spec(gpu_selector=["b:1"]), fleet, full, profile=SMALL)
    assert r.ok and r.placement.worker_id == "wid-b" and r.placement.gpu_indexes == [1]
    assert len(r.placement.warnings) == 1 and "Overcommit: b GPU 1" in r.placement.warnings[0]
    assert "8.00 GiB unclaimed (90% claimed)" in r.placement.warnings[0]
    r = plan_placement(spec(gpu_selector=["a:0"]), fleet, [], profile=BIG)  # too small: warned
    assert r.ok and any("needs" in w for w in r.placement.warnings)
    r = plan_placement(spec(gpu_selector=["a:0", "b:0"]), fleet, [], profile=BIG)
    assert (r.placement.tp, r.placement.pp) == (1, 2) and not r.placement.warnings
    r = plan_placement(spec(gpu_selector=["a:0", "a:1", "b:0"]), fleet, [], profile=BIG)
    assert (r.placement.tp, r.placement.pp) == (1, 3)  # uneven: TP=1, PP=3
    r = plan_placement(spec(gpu_selector=["zz:0", "a:7", "nonsense"]), fleet, [], profile=SMALL)
    assert not r.ok and "not registered" in r.reason and "no GPU 7 (its GPUs: 0, 1)" in r.reason
    assert "'nonsense' is not 'worker-name:gpu-index'" in r.reason


def test_cpu_only_fleet_places_by_ram() -> None:
    fleet = [worker("a", ram_gib=8), worker("b", ram_gib=64), worker("c", ram_gib=64)]
    r = plan_placement(spec(), fleet, [], profile=profile(2))  # auto: no GPU anywhere
    assert r.ok and r.placement.gpu_indexes == [] and r.claim.device == "cpu"
    assert r.placement.worker_id == "wid-b" and r.placement.claim.ram == r.claim.total
    planner = Planner(fleet, [placed(r.placement)])
    again = planner.place(spec(), profile(2))
    assert again.placement.worker_id == "wid-b"  # binpack: the fuller of b and c
    r = plan_placement(spec(device="cpu"), [worker("g", 4, ram_gib=16)], [], profile=profile(1.5))
    assert r.ok and r.placement.gpu_indexes == [] and r.placement.claim.ram > 0


def test_cpu_placement_with_tp_pp_splits_a_workers_cores() -> None:
    small = worker("small", ram_gib=64)
    small.status.cpu_cores = 2
    fleet = [small, worker("big", ram_gib=64)]  # 32 cores
    r = plan_placement(spec(device="cpu", tp=2, pp=2), fleet, [], profile=profile(1.5))
    assert r.ok and r.placement.worker_id == "wid-big"
    assert (r.placement.tp, r.placement.pp) == (2, 2)
    r = plan_placement(spec(device="cpu", pp=2), [small], [], profile=profile(1.5))
    assert r.ok and (r.placement.tp, r.placement.pp) == (1, 2)
    smol = profile(0.135, layers=30, heads=9, kv_heads=3, hidden=576)  # SmolLM2-135M's shape
    r = plan_placement(spec(device="cpu", tp=3), [small], [], profile=smol)
    assert not r.ok and "runs 3 engine ranks, one CPU core each" in r.reason
    assert "small, has 2" in r.reason
    with pytest.raises(InvalidRequest) as refused:
        plan_placement(spec(device="cpu", tp=2), fleet, [], profile=smol)
    assert refused.value.param == "tp" and "tp=2 cannot work" in refused.value.message
    assert "9 attention heads" in refused.value.message


def test_filters_status_labels_gpu_type() -> None:
    fleet = [worker("a", 1, state=WorkerState.NOT_READY), worker("b", 1, labels={"zone": "x"}),
             worker("c", 1, gpu_name="NVIDIA A10", gpu_gib=24, labels={"zone": "x"}),
             worker("d", 1, state=WorkerState.DRAINING)]
    r = plan_placement(spec(worker_selector={"zone": "x"}, gpu_type="a10"), fleet, [],
                       profile=SMALL)
    assert r.placement.worker_id == "wid-c"
    assert r.messages == ["Matched 2/4 workers by READY status.",
                          "Matched 2/2 workers by labels zone=x.",
                          "Matched 1/2 workers by GPU type 'a10'."]
    r = plan_placement(spec(worker_selector={"zone": "y"}), fleet, [], profile=SMALL)
    assert not r.ok and "Matched 0/2 workers by labels zone=y." in r.reason


def test_encoder_shares_a_gpu() -> None:
    tiny = profile(0.02, heads=12, kv_heads=12, hidden=384, causal=False)
    planner = Planner([worker("a", 1)])
    first = planner.place(spec(), tiny)
    planner.commit(first)
    second = planner.place(spec(), tiny)
    assert second.placement.gpu_indexes == [0]
    assert first.placement.claim.gpu_memory[0] == first.claim.per_gpu(1)


def test_incremental_accounting_matches_a_rebuild() -> None:
    fleet = [worker("a", 4), worker("b", 4)]
    planner = Planner(fleet)
    accepted = []
    for _ in range(8):
        r = planner.place(spec(), SMALL)
        assert r.ok
        planner.commit(r)
        accepted.append(placed(r.placement))
    assert not planner.place(spec(), SMALL).ok
    assert [(p.worker_id, p.gpu_indexes[0]) for p in accepted][:4] == [
        ("wid-a", 0), ("wid-a", 1), ("wid-a", 2), ("wid-a", 3)]  # binpack fills a first
    rebuilt = Planner(fleet, accepted)
    for name in ("a", "b"):
        assert ([g.allocated for g in rebuilt.index.by_name[name].gpus]
                == [g.allocated for g in planner.index.by_name[name].gpus])
    planner.index.account(accepted[0], sign=-1)  # an instance deleted: its GPU is free again
    r = planner.place(spec(), SMALL)
    assert (r.placement.worker_id, r.placement.gpu_indexes) == ("wid-a", [0])


def test_a_miss_is_remembered_until_something_is_released() -> None:
    big = profile(120)  # ~224 GiB: four 80 GB GPUs
    planner = Planner([worker("a", 4)])
    first = planner.place(spec(), SMALL)
    planner.commit(first)
    miss = planner.place(spec(), big)
    assert not miss.ok and planner.place(spec(), big) is miss  # answered from the miss cache
    planner.index.account(placed(first.placement), sign=-1)
    again = planner.place(spec(), big)
    assert again is not miss and again.ok and again.placement.tp == 4


def test_cpu_pipeline_stages_go_across_workers_when_none_alone_fits() -> None:
    model = profile(40)  # ~150 GiB in float32 on CPU
    fleet = [worker("a", ram_gib=100), worker("b", ram_gib=100)]
    r = plan_placement(spec(device="cpu"), fleet, [], profile=model)
    assert not r.ok  # pp unset: one worker, and neither holds it
    r = plan_placement(spec(device="cpu", pp=2), fleet, [], profile=model)
    assert r.ok and (r.placement.tp, r.placement.pp) == (1, 2)
    [sub] = r.placement.subordinate_workers
    assert {r.placement.worker_id, sub.worker_id} == {"wid-a", "wid-b"}
    assert r.placement.claim.ram + sub.claim.ram >= r.claim.total  # each its stage's half
    assert r.placement.claim.ram == sub.claim.ram == -(-r.claim.total // 2)
    assert "of a's RAM" in r.describe() and "of b's RAM" in r.describe()
    # the next placement sees both halves claimed: a second copy does not fit
    planner = Planner(fleet, [placed(r.placement)])
    again = planner.place(spec(device="cpu", pp=2), model)
    assert not again.ok and "Across workers, the 2 pipeline stages need" in again.reason
    # a model that is not `distributed` keeps its stages on one worker, and says so
    r = plan_placement(spec(device="cpu", pp=2, distributed=False), fleet, [], profile=model)
    assert not r.ok and "stages stay on one worker" in r.reason


def test_cpu_pipeline_stages_spread_when_asked() -> None:
    fleet = [worker("a", ram_gib=64), worker("b", ram_gib=64)]
    r = plan_placement(spec(device="cpu", pp=2), fleet, [], profile=profile(1.5))
    assert r.ok and not r.placement.subordinate_workers  # fits one worker: binpack keeps it
    r = plan_placement(spec(device="cpu", pp=2, placement_strategy="spread"), fleet, [],
                       profile=profile(1.5))
    assert r.ok and len(r.placement.subordinate_workers) == 1
    assert r.placement.subordinate_workers[0].worker_id != r.placement.worker_id
    # pp=3 over two workers: the lead takes two stages (and their RAM), the other one
    r = plan_placement(spec(device="cpu", pp=3, placement_strategy="spread"), fleet, [],
                       profile=profile(1.5))
    [sub] = r.placement.subordinate_workers
    assert r.placement.claim.ram > sub.claim.ram > 0


def test_cpu_vllm_goes_across_workers_only_when_asked() -> None:
    """vLLM-CPU has no Ray executor: the scheduler never chooses a split it would refuse (the
    instance would go to ERROR and be restarted again and again); `spread` still asks for it."""
    model = profile(40)  # ~150 GiB in float32 on CPU
    fleet = [worker("a", ram_gib=100), worker("b", ram_gib=100)]
    r = plan_placement(spec(device="cpu", pp=2, backend="vllm"), fleet, [], profile=model)
    assert not r.ok and "no Ray executor" in r.reason
    r = plan_placement(spec(device="cpu", pp=2, backend="vllm", placement_strategy="spread"),
                       fleet, [], profile=model)
    assert r.ok and len(r.placement.subordinate_workers) == 1
    small = plan_placement(spec(device="cpu", pp=2, backend="vllm"), fleet, [],
                           profile=profile(1.5))
    assert small.ok and not small.placement.subordinate_workers


def test_vllm_spans_workers_over_ray_and_a_custom_server_stays_on_one() -> None:
    """vllm across workers runs on Ray (its head on the main worker, followers on the others):
    the scheduler places it across as it does our engine; a custom server is one process, kept
    on one worker (or PENDING with why) rather than placed to fail."""
    fleet = [worker("a", 1), worker("b", 1)]
    assert plan_placement(spec(), fleet, [], profile=BIG).placement.subordinate_workers
    r = plan_placement(spec(backend="vllm"), fleet, [], profile=BIG)
    assert r.ok and len(r.placement.subordinate_workers) == 1
    custom = spec(backend="custom", backend_command="serve {model_path} --port {port}")
    r = plan_placement(custom, fleet, [], profile=BIG)
    assert not r.ok and "backend custom: a custom server runs as one process" in r.reason
    r = plan_placement(custom, [worker("a", 2), worker("b", 1)], [], profile=BIG)
    assert r.ok and not r.placement.subordinate_workers and r.placement.tp == 2
