"""When nothing fits, the message says why with the right numbers, in plain sentences."""

from __future__ import annotations

from tests.unit.scheduler.sched_fleet import GIB, claimed_gpu, profile, spec, worker

from shoal.services.scheduler.claim import compute_claim
from shoal.services.scheduler.planner import plan_placement
from shoal.shared.units import fmt_bytes

HUGE = profile(400, layers=80, heads=64, kv_heads=8, hidden=8192)
BIG = profile(70, layers=80, heads=64, kv_heads=8, hidden=8192)


def test_largest_gpu_and_best_combinations_with_numbers() -> None:
    claim = compute_claim(HUGE, spec(), "gpu")
    fleet = [worker("a", [80, 80]), worker("b", 4, gpu_gib=24)]
    r = plan_placement(spec(), fleet, [claimed_gpu("wid-a", 0, 20 * GIB)], profile=HUGE)
    assert not r.ok and r.placement is None
    text = r.reason
    assert text.startswith(f"The model needs {fmt_bytes(claim.total)} of GPU memory: weights "
                           f"{fmt_bytes(claim.weights)} (400.0B parameters in bfloat16)")
    need1 = claim.per_gpu(1)
    assert (f"No single GPU fits the {fmt_bytes(need1)} the model needs on one GPU. The largest "
            f"qualifying GPU is a GPU 1 (NVIDIA H100 80GB, 80.0 GiB): 0% claimed, 80.0 GiB "
            f"unclaimed; it offers 72.0 GiB, {fmt_bytes(need1 - int(72 * GIB))} short.") in text
    need4 = claim.per_gpu(4)
    assert (f"The best multi-GPU worker is b with 4 qualifying GPUs (TP=4, PP=1): each offers "
            f"21.6 GiB, but the model needs {fmt_bytes(need4)} per GPU on 4 GPUs, "
            f"{fmt_bytes(need4 - int(24 * GIB * 0.9))} short.") in text
    need2 = claim.per_gpu(2)
    assert ("Across 2 workers, 5 GPUs qualify. The best multi-worker combination is 2 workers x "
            f"1 GPU (TP=1, PP=2): its weakest GPU offers 21.6 GiB, but the model needs "
            f"{fmt_bytes(need2)} per GPU on 2 GPUs") in text
    need5 = claim.per_gpu(5)
    assert (f"Even with TP=1 and PP=5 over the 5 largest qualifying GPUs, each needs "
            f"{fmt_bytes(need5)} and the smallest offers 21.6 GiB") in text


def test_utilisation_threshold_is_explained() -> None:
    fleet = [worker("a", 2)]
    claimed = [claimed_gpu("wid-a", 0, 20 * GIB), claimed_gpu("wid-a", 1, 10 * GIB)]
    r = plan_placement(spec(), fleet, claimed, profile=BIG)
    assert ("with gpu_memory_utilization 0.9 an instance takes 90% of each GPU it uses, so a GPU "
            "qualifies only if 90% of it is unclaimed, and none is") in r.reason
    assert ("The largest GPU free is a GPU 1 (NVIDIA H100 80GB, 80.0 GiB): 12% claimed, "
            "70.0 GiB unclaimed.") in r.reason
    assert "No eligible worker has a qualifying GPU" in r.reason


def test_tp_rule_is_explained_for_nine_heads() -> None:
    nine = profile(70, layers=30, heads=9, kv_heads=3, hidden=576 * 8)
    r = plan_placement(spec(distributed=False), [worker("a", 2)], [], profile=nine)
    assert ("No multi-GPU split on one worker is possible: the tensor-parallel size must split "
            "the 9 attention heads and 3 KV heads (divide the heads and the MLP size, and divide "
            "the KV heads or be a multiple of them: sizes 3, 9), and the largest worker has 2 "
            "GPUs.") in r.reason
    fleet = [worker("a", 4), worker("b", 2)]
    claimed = [claimed_gpu("wid-a", i, 40 * GIB) for i in (0, 1)]
    r = plan_placement(spec(distributed=False), fleet, claimed, profile=nine)
    assert ("A multi-GPU split on one worker needs 3 qualifying GPUs (the counts whose "
            "tensor-parallel size divides the 9 attention heads and 3 KV heads); the most any "
            "eligible worker has is 2.") in r.reason


def test_cpu_reason_gives_ram_numbers() -> None:
    claim = compute_claim(BIG, spec(device="cpu"), "cpu")
    fleet = [worker("a", ram_gib=100), worker("b", ram_gib=200)]
    r = plan_placement(spec(device="cpu"), fleet, [], profile=BIG)
    assert r.reason == (
        f"{claim.describe()} No worker has the {fmt_bytes(claim.total)} of RAM the model needs on "
        f"CPU unclaimed: the largest is b with 200.0 GiB unclaimed of 200.0 GiB (0% claimed), "
        f"{fmt_bytes(claim.total - 200 * GIB)} short.")


def test_empty_fleet_and_filtered_fleet() -> None:
    r = plan_placement(spec(), [], [], profile=BIG)
    assert not r.ok and r.reason.endswith("No worker is eligible.")
    r = plan_placement(spec(worker_selector={"gpu": "big"}), [worker("a", 8)], [], profile=BIG)
    assert "Matched 0/1 workers by labels gpu=big. No worker is eligible." in r.reason


def test_dry_run_text_of_a_placement() -> None:
    r = plan_placement(spec(), [worker("a", 8)], [], profile=BIG)
    assert r.describe().startswith("Placement: a GPUs [0, 1], TP=2 PP=1, score ")
    assert "The model needs" in r.describe()
