"""Which ranks of a multi-worker instance each worker runs (shared/schemas/ranks.py): the
arithmetic the scheduler's RAM claims and the engine's rank plan share."""

from __future__ import annotations

from datetime import UTC, datetime

from shoal.services.engine import RankLaunch, core_shares
from shoal.shared.schemas.ranks import RankExit, rank_layout, split_stages
from shoal.shared.schemas.registry import InstancePublic, ResourceClaim, SubordinateWorker
from shoal.shared.states import InstanceState

NOW = datetime(2026, 1, 1, tzinfo=UTC)


def instance(tp: int, pp: int, gpus: list[int], subs: list[list[int]]) -> InstancePublic:
    return InstancePublic(
        id="i1", name="m-i1", model_id="m", model_name="m", state=InstanceState.STARTING,
        worker_id="wa", worker_name="a", gpu_indexes=gpus, tp=tp, pp=pp,
        subordinate_workers=[SubordinateWorker(worker_id=f"w{i}", worker_name=f"s{i}",
                                               gpu_indexes=g, claim=ResourceClaim())
                             for i, g in enumerate(subs)],
        created_at=NOW, updated_at=NOW, state_changed_at=NOW, version=1)


def test_split_stages_gives_the_remainder_to_the_first() -> None:
    assert split_stages(2, 2) == [1, 1]
    assert split_stages(3, 2) == [2, 1]
    assert split_stages(5, 3) == [2, 2, 1]


def test_cpu_layout_splits_stages_evenly_lead_first() -> None:
    layout = rank_layout(instance(1, 2, [], [[]]))
    assert [(w.worker_name, w.ranks) for w in layout] == [("a", [0]), ("s0", [1])]
    layout = rank_layout(instance(2, 3, [], [[]]))  # ranks = pp_rank * tp + tp_rank
    assert [w.ranks for w in layout] == [[0, 1, 2, 3], [4, 5]]


def test_gpu_layout_follows_each_workers_gpus() -> None:
    # tp=2, pp=3: the lead has 2 GPUs (one stage), the subordinate 4 (two stages)
    layout = rank_layout(instance(2, 3, [0, 1], [[0, 1, 2, 3]]))
    assert [w.ranks for w in layout] == [[0, 1], [2, 3, 4, 5]]


def test_core_split_and_exit_wording() -> None:
    assert core_shares([0, 1, 2, 3], 2) == [[0, 1], [2, 3]]
    assert core_shares([0], 2) == [[0], [0]]
    event = RankExit(instance_id="i1", generation="g", worker_id="w0", worker_name="s0", rank=1,
                     code=-9)
    assert event.describe() == "rank 1 on worker s0 exited with code -9"


def test_worker_cpus_is_what_the_worker_reports() -> None:
    from types import SimpleNamespace

    from shoal.services.worker.agent import WorkerAgent
    from shoal.shared.config import Settings

    bus = SimpleNamespace(subjects=SimpleNamespace(registry=None))  # devices() needs no bus
    agent = WorkerAgent(Settings(worker_cpus=[1]), bus=bus)  # type: ignore[arg-type]
    assert agent.devices().cpu_cores == 1


def test_a_rank_launch_is_parsed_back_as_it_was_built() -> None:
    """The worker and the engine's executor build a RankLaunch; rank_process.py parses its
    command line: one description of a rank, both ways."""
    launch = RankLaunch.build(rank=3, config={"model": "m", "num_threads": None, "device": "auto"},
                              cores=[4, 5], init_method="tcp://10.0.0.2:29500", device="cuda:1",
                              visible_gpus=(2, 3), instance_id="i1", cache_dir="/c")
    assert launch.config["num_threads"] == 2 and launch.config["device"] == "cuda:1"
    argv = launch.argv()
    assert argv[1:3] == ["-m", "shoal.services.engine.distributed.rank_process"]
    again = RankLaunch.parse(argv[3:])
    assert again == RankLaunch(rank=3, init_method="tcp://10.0.0.2:29500", config=launch.config,
                               cores=(4, 5), cache_dir="/c", instance_id="i1")
    env = launch.env({"PATH": "/bin", "OMP_NUM_THREADS": "64"})
    assert env == {"PATH": "/bin", "OMP_NUM_THREADS": "2", "CUDA_VISIBLE_DEVICES": "2,3"}
