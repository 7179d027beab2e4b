"""The CPU op set: paged attention and the KV write as a C++ op that reads the paged cache in
place (csrc/cpu_attention.cpp), instead of gathering K/V into a padded copy first.

The op is compiled by torch.utils.cpp_extension with the machine's g++ (-O3 -march=native) at
first use, or by `make install`, and cached under torch's extensions folder (TORCH_EXTENSIONS_DIR,
default ~/.cache/torch_extensions): a later process loads the cached library in milliseconds.
Where it cannot be built (no compiler), the plain-torch ops stay in use, with a warning.
"""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("csrc") / "cpu_attention.cpp"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
"""-fopenmp compiles at::parallel_for's OpenMP loop; it links against torch's own libgomp."""


@functools.cache
def load() -> bool:
    """Build (once per machine) and load the library; False when it cannot be built."""
    try:
        from torch.utils.cpp_extension import load as build

        build(name="shoal_cpu_attention", sources=[str(SOURCE)], extra_cflags=FLAGS,
              is_python_module=False, verbose=False)
    except Exception as exc:  # no compiler, no headers: the torch ops still work
        warnings.warn(f"the C++ attention op could not be built ({exc}); using the torch ops",
                      stacklevel=2)
        return False
    return True


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                    workspace: object = None) -> torch.Tensor:
    """paged_attention.paged_attention's signature; `workspace` is not needed (no gather)."""
    return torch.ops.shoal_cpu.paged_attention(q, k_cache, v_cache, block_tables, seq_lens,
                                               query_start_loc, scale, window or 0)


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    torch.ops.shoal_cpu.reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
