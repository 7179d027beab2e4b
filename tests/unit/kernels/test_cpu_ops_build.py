"""The C++ op build must not wait on a lock file a killed build left behind (torch's own
FileBaton waits on one forever: a CI run hung there)."""

from __future__ import annotations

import threading
import time

from shoal.kernels import cpu_ops


def test_a_stale_lock_file_is_cleared_before_building(tmp_path):
    build_dir = tmp_path / "shoal_cpu_attention"
    build_dir.mkdir()
    (build_dir / "lock").touch()  # what a SIGKILLed build leaves
    seen: list[bool] = []
    cpu_ops.build_locked(build_dir, lambda: seen.append((build_dir / "lock").exists()))
    assert seen == [False]


def test_builders_take_turns(tmp_path):
    build_dir = tmp_path / "ops"
    spans: list[tuple[float, float]] = []

    def build() -> None:
        start = time.monotonic()
        time.sleep(0.2)
        spans.append((start, time.monotonic()))

    threads = [threading.Thread(target=cpu_ops.build_locked, args=(build_dir, build))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    (a_start, a_end), (b_start, b_end) = sorted(spans)
    assert b_start >= a_end  # the second waited for the first


def test_the_build_root_follows_torch_extensions_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert cpu_ops.build_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert cpu_ops.build_root().name == "torch_extensions"
