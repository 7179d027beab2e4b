"""A wheel built from the tree carries everything the package reads from its own folders (the
C++ ops' sources, the migrations, the dashboard), and the C++ ops build and run from it: a
non-editable install (a wheel, the compose image) must not fall back to the slow torch path."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # a copy of the tree, so the build's own build/ and egg-info never touch the checkout
    src = out / "src"
    files = subprocess.run(["git", "-C", str(ROOT), "ls-files", "-co", "--exclude-standard"],
                           check=True, capture_output=True, text=True).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            (src / name).write_bytes((ROOT / name).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(src)], check=True)
    (built,) = out.glob("shoal-*.whl")
    return built


def test_the_wheel_carries_the_cpp_sources_and_package_data(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    for cpp in sorted((ROOT / "kernels" / "csrc").glob("*.cpp")):
        assert f"shoal/kernels/csrc/{cpp.name}" in names
    assert any(n.startswith("shoal/shared/db/migrations/versions/") for n in names)
    assert "shoal/services/gateway/management/static/index.html" in names
    assert not any(n.split("/")[0] in ("services", "shared", "kernels") for n in names)


def test_the_cpp_ops_build_and_run_from_the_wheel(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    probe = (
        "import torch, shoal.kernels as k, shoal.kernels.cpu_ops as c\n"
        f"assert c.__file__.startswith({str(site)!r}), c.__file__\n"
        "assert c.unavailable_reason() is None, c.unavailable_reason()\n"
        "ops = k.select_ops('cpu')\n"
        "assert ops.name == 'cpp' and ops.describe() == 'cpp ops', ops.describe()\n"
        "x, w = torch.randn(3, 64), torch.randn(64)\n"
        "ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w\n"
        "assert torch.allclose(ops.rms_norm(x, w, 1e-6), ref, atol=1e-5)\n"
        "print('ok')\n")
    # the wheel's folder first on the path: the editable install of the checkout is not seen;
    # a build cache of its own (about a minute of g++), so the environment's cache, built from
    # the checkout's paths, is neither reused nor rebuilt
    env = {**os.environ, "PYTHONPATH": str(site), "TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


def test_missing_sources_say_why_at_start(wheel: Path, tmp_path: Path) -> None:
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    for cpp in (site / "shoal" / "kernels" / "csrc").glob("*.cpp"):
        cpp.unlink()
    probe = ("import warnings, shoal.kernels as k\n"
             "warnings.simplefilter('ignore')\n"
             "print(k.select_ops('cpu').describe())\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("torch ops (C++ ops unavailable: FileNotFoundError: sources "
                                 "not installed:"), run.stdout
