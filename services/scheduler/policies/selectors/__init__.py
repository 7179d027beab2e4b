"""Candidate selectors, tried in order; the first that returns candidates wins."""

from __future__ import annotations

from shoal.services.scheduler.policies.selectors.cpu_selector import CpuSelector
from shoal.services.scheduler.policies.selectors.manual_selector import ManualGpuSelector
from shoal.services.scheduler.policies.selectors.multi_gpu_selector import MultiGpuSelector
from shoal.services.scheduler.policies.selectors.multi_worker_selector import MultiWorkerSelector
from shoal.services.scheduler.policies.selectors.single_gpu_selector import SingleGpuSelector

__all__ = ["CpuSelector", "ManualGpuSelector", "MultiGpuSelector", "MultiWorkerSelector",
           "SingleGpuSelector"]
