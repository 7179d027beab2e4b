"""Byte and count formatting for messages users read ("72.0 GiB"), and the byte units: one place
so every reason, table and default agrees."""

from __future__ import annotations

GIB = 1024**3
MIB = 1024**2


def fmt_bytes(num_bytes: int | float) -> str:
    """GiB with one decimal from 1 GiB up (two below 10 GiB), MiB below."""
    if abs(num_bytes) >= GIB:
        value = num_bytes / GIB
        return f"{value:.2f} GiB" if value < 10 else f"{value:.1f} GiB"
    return f"{num_bytes / MIB:.0f} MiB"


def fmt_pct(fraction: float) -> str:
    return f"{fraction * 100:.0f}%"


def fmt_count(num: int, noun: str) -> str:
    """'1 GPU', '3 GPUs'."""
    return f"{num} {noun}" if num == 1 else f"{num} {noun}s"


def fmt_params(num_params: int) -> str:
    return f"{num_params / 1e9:.1f}B" if num_params >= 1e9 else f"{num_params / 1e6:.1f}M"
