"""Run the Triton kernels in Triton's CPU interpreter when no CUDA device is present.

TRITON_INTERPRET is read when a `@triton.jit` function is defined, so it is set here, before any
test module imports a kernel module; kernel modules imported earlier without it are dropped from
sys.modules so the tests import them afresh. With CUDA the kernels compile for the GPU instead.
"""

from __future__ import annotations

import os
import sys

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
    for _name in [n for n in sys.modules
                  if n.startswith("shoal.kernels.") and ("triton" in n or "split_k" in n)]:
        del sys.modules[_name]


def pytest_report_header() -> str:
    if HAS_CUDA:
        return f"kernels_triton: compiled for {torch.cuda.get_device_name()}"
    return ("kernels_triton: no CUDA device: Triton kernels run in the CPU interpreter "
            "(TRITON_INTERPRET=1, fp32/fp16, small shapes); CUDA-only tests are skipped")
