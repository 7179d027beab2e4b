"""Rank 0 names a rank that ends before the rendezvous completes at once, not at the store's
300 s timeout: one of its own children (exit code) or one a subordinate worker reports (the
bus fills `peer_failures`). Without the check both tests would block for 300 s."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from shoal.services.engine.config import EngineConfig
from shoal.services.engine.distributed import executor as executor_mod
from shoal.services.engine.distributed.executor import MultiprocExecutor, RankFailed
from shoal.services.engine.distributed.rank_process import parse_init_method
from tests.tiny_models import save_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model("llama", tmp_path_factory.mktemp("rdv"))


def _config(tiny: Path, **extra: object) -> EngineConfig:
    return EngineConfig(model=str(tiny), device="cpu", dtype="float32",
                        pipeline_parallel_size=2, **extra)  # type: ignore[arg-type]


def test_a_local_rank_dying_before_the_rendezvous_is_named(
        tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def dies(rank: int, *_: object) -> subprocess.Popen[bytes]:
        return subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])

    monkeypatch.setattr(executor_mod, "_start_rank", dies)
    with pytest.raises(RankFailed, match="rank 1 exited with code 3"):
        MultiprocExecutor(_config(tiny), tiny)


def test_a_remote_rank_dying_before_the_rendezvous_is_named(tiny: Path) -> None:
    reported = {1: "rank 1 on worker b exited with code -9"}
    port = executor_mod._free_port()
    with pytest.raises(RankFailed, match="rank 1 on worker b exited with code -9"):
        MultiprocExecutor(_config(tiny, distributed_init_method=f"tcp://127.0.0.1:{port}"),
                          tiny, local_ranks=[], peer_failures=lambda: reported)


def test_parse_init_method() -> None:
    assert parse_init_method("tcp://10.0.0.2:29500") == ("10.0.0.2", 29500)
    with pytest.raises(ValueError, match="tcp://host:port"):
        parse_init_method("env://")
