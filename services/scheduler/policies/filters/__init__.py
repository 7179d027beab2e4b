"""Worker filters, run before any fit: status, labels, GPU type (GPUStack's order)."""

from __future__ import annotations

from shoal.services.scheduler.policies.filters.gpu_type_filter import GpuTypeFilter
from shoal.services.scheduler.policies.filters.label_filter import LabelFilter
from shoal.services.scheduler.policies.filters.status_filter import StatusFilter

__all__ = ["GpuTypeFilter", "LabelFilter", "StatusFilter"]
