"""Give back to the OS the heap that a large input left behind.

Tokenizing a prompt of megabytes allocates hundreds of MB in small pieces, which the tokenizer
frees and glibc keeps (per-thread arenas are not trimmed): one 2.6 MB prompt left a process with
SmolLM2's tokenizer 340 MB larger for good, per tokenizing thread, which is how an engine grew
from 2.6 to 4.4 GB over a campaign of bad inputs and stayed there (issue 24). glibc's
`malloc_trim(0)` returns what is free in every arena (measured: 691 -> 360 MB). It is called
after an input of TRIM_AFTER_BYTES or more only: such inputs are rare, and a trim is quick.
Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from collections.abc import Callable

TRIM_AFTER_BYTES = 512 * 1024


def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


_TRIM = _malloc_trim()


def trim_after(size: int) -> bool:
    """After an input of `size` bytes: give the free heap back when it was large (True if a
    trim ran)."""
    if size < TRIM_AFTER_BYTES or _TRIM is None:
        return False
    _TRIM(0)
    return True
