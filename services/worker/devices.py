"""What a worker has: CPU cores and RAM always, NVIDIA GPUs when torch sees CUDA, or a
simulated set (`8xH100-80GB`, `2xA10-24GB,1xcpu`) for capacity planning and scheduler tests.

No torch import at module level: the agent stays light, and torch is asked only when present.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import psutil

from shoal.shared.errors import InvalidRequest
from shoal.shared.schemas.registry import DeviceStatus, GpuDevice
from shoal.shared.units import GIB

_ITEM = re.compile(r"^(?P<count>\d+)x(?P<what>[A-Za-z0-9_.\-]+)$")
_GPU = re.compile(r"^(?P<name>[A-Za-z0-9_.]+(?:-[A-Za-z0-9_.]+)*?)-(?P<gib>\d+)(?:GB|G|GiB)$",
                  re.IGNORECASE)
SIMULATED_CPU_CORES = 16
SIMULATED_RAM = 64 * GIB


def detect_devices() -> DeviceStatus:
    mem = psutil.virtual_memory()
    return DeviceStatus(cpu_cores=os.cpu_count() or 1, memory_total=mem.total,
                        memory_used=mem.total - mem.available, gpus=detect_gpus())


def detect_gpus() -> list[GpuDevice]:
    """nvidia-smi when present (no CUDA context in the agent, as GPUStack does), else torch."""
    smi = shutil.which("nvidia-smi")
    if smi is not None:
        try:
            return _gpus_from_smi(smi)
        except (OSError, subprocess.SubprocessError, ValueError):
            pass
    if os.path.exists("/proc/driver/nvidia/version"):  # a driver but no nvidia-smi: ask torch
        return _gpus_from_torch()
    return []


def _gpus_from_smi(smi: str) -> list[GpuDevice]:
    out = subprocess.run(
        [smi, "--query-gpu=index,name,memory.total,memory.used,utilization.gpu",
         "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10, check=True,
    ).stdout
    gpus = []
    for line in filter(None, (raw.strip() for raw in out.splitlines())):
        index, name, total, used, util = (field.strip() for field in line.split(","))
        gpus.append(GpuDevice(index=int(index), name=name, memory_total=int(total) * 1024**2,
                              memory_used=int(used) * 1024**2,
                              utilization=float(util) if util.replace(".", "").isdigit() else None))
    return gpus


def _gpus_from_torch() -> list[GpuDevice]:
    try:
        import torch
    except ImportError:
        return []
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        gpus.append(GpuDevice(index=index, name=torch.cuda.get_device_name(index), vendor="nvidia",
                              memory_total=total, memory_used=total - free))
    return gpus


def parse_simulated(spec: str) -> DeviceStatus:
    """`8xH100-80GB` -> 8 GPUs named H100 of 80 GiB; `1xcpu` adds nothing but is allowed, so
    `1xcpu` alone is a CPU-only worker. Every simulated worker reports 16 cores and 64 GiB RAM."""
    gpus: list[GpuDevice] = []
    for item in (part.strip() for part in spec.split(",")):
        match = _ITEM.match(item)
        if not match:
            raise InvalidRequest(f"bad simulated device {item!r}: expected COUNTxNAME-SIZEGB or "
                                 "COUNTxcpu", param="simulate_devices")
        count, what = int(match["count"]), match["what"]
        if what.lower() == "cpu":
            continue
        gpu = _GPU.match(what)
        if not gpu or count < 1:
            raise InvalidRequest(f"bad simulated GPU {what!r}: expected NAME-SIZEGB, "
                                 "e.g. H100-80GB", param="simulate_devices")
        for _ in range(count):
            gpus.append(GpuDevice(index=len(gpus), name=gpu["name"], vendor="nvidia (simulated)",
                                  memory_total=int(gpu["gib"]) * GIB, memory_used=0))
    return DeviceStatus(cpu_cores=SIMULATED_CPU_CORES, memory_total=SIMULATED_RAM, memory_used=0,
                        gpus=gpus)
