"""The CPU op set: paged attention and the KV write as a C++ op that reads the paged cache in
place (csrc/cpu_attention.cpp), instead of gathering K/V into a padded copy first; RMSNorm (with
its residual add) and rotary embedding as one pass each (csrc/cpu_norm_rotary.cpp); a whole MoE
layer of a small step, router to combined output, in one call over expert stacks packed at load
(`moe_pack`, `moe_forward`, csrc/cpu_moe.cpp; layers/moe.py), and with the same panels the fp32
matmul of a small step of a dense Linear (`dense_pack`, `panel_matmul`; layers/cpu_weights.py);
the plain-layout GEMV of one or two rows (csrc/cpu_gemv.cpp) it replaced stays as the
benchmarks' reference (benchmarks/cpu_gemv.py, gguf_kernels.py).

The op is compiled by torch.utils.cpp_extension with the machine's g++ (-O3 -march=native) at
first use, or by `make install`, and cached in the environment that runs it
(`<sys.prefix>/torch_extensions`, or TORCH_EXTENSIONS_DIR when set): a later process loads the
cached library in milliseconds. The sources ship in the package (package data), so a wheel or the
compose image builds them too. Where they cannot be built (no compiler, no headers, sources
missing), the plain-torch ops stay in use: `load()` warns once, `unavailable_reason()` says why,
and the engine's start line (`attention: torch ops (C++ ops unavailable: ...)`) repeats it.

Why not torch's default folder (~/.cache/torch_extensions): it is shared by every checkout on the
machine, and torch guards a build with a plain lock file that a killed build leaves behind, on
which every later build then waits forever (a CI run hung on one). Here a build holds an flock,
which the kernel drops when its process dies, and removes any lock file it finds under it.
"""

from __future__ import annotations

import fcntl
import functools
import os
import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from shoal.kernels.paged_attention import prefill_chunk

SOURCES = [Path(__file__).with_name("csrc") / name
           for name in ("cpu_attention.cpp", "cpu_norm_rotary.cpp", "cpu_gemv.cpp",
                        "cpu_gguf.cpp", "cpu_moe.cpp")]
NAME = "shoal_cpu_ops"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-DNDEBUG"]
"""-fopenmp compiles at::parallel_for's OpenMP loop; it links against torch's own libgomp."""


def build_root() -> Path:
    """Where built ops are cached: TORCH_EXTENSIONS_DIR, else inside this Python environment
    (a fresh venv builds afresh), else the user's cache when the environment is read-only."""
    if env := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(env)
    root = Path(sys.prefix) / "torch_extensions"
    if os.access(sys.prefix, os.W_OK) or root.is_dir():
        return root
    return Path.home() / ".cache" / "shoal" / "torch_extensions"


def build_locked(build_dir: Path, build) -> None:
    """Run `build` under an flock on `build_dir`, after removing torch's lock file: while the
    flock is held no other builder runs, so a lock file there is a killed build's leftover."""
    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir.with_suffix(".flock"), "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        build()


def load() -> bool:
    """Build (once per machine) and load the library; False when it cannot be built."""
    return unavailable_reason() is None


@functools.cache
def unavailable_reason() -> str | None:
    """None once the library is loaded; else why it could not be (warned once)."""
    missing = [str(s) for s in SOURCES if not s.is_file()]
    try:
        if missing:
            raise FileNotFoundError(f"sources not installed: {', '.join(missing)}")
        from torch.utils.cpp_extension import load as build

        build_dir = build_root() / NAME
        build_locked(build_dir, lambda: build(
            name=NAME, sources=[str(s) for s in SOURCES], extra_cflags=FLAGS,
            is_python_module=False, verbose=False, build_directory=str(build_dir)))
    except Exception as exc:  # no compiler, no headers: the torch ops still work
        last = (str(exc).strip().splitlines() or [""])[-1]  # a failed build's last line says why
        reason = f"{type(exc).__name__}: {last}"
        warnings.warn(f"the C++ CPU ops could not be built ({reason}); using the torch ops",
                      stacklevel=3)
        return reason
    return None


@functools.cache
def op(name: str) -> Callable[..., Any]:
    """The library op `name` as its default overload's C++ callable. Why: a decode step makes ~8
    of these calls a layer, and `torch.ops.shoal_cpu.<name>(...)` spends ~5 us of a small op's
    ~11 us (1 thread, this machine) finding the overload and crossing torch's Python dispatch
    layers before the C++ dispatcher; this enters at the dispatcher (profiler records kept)."""
    overload = getattr(torch.ops.shoal_cpu, name).default
    return getattr(overload, "_op", overload)  # (a private attribute: the overload without it)


LONG_CHUNK = 128
"""Prefill chunks of at least this many tokens go to the torch op (gather + SDPA): its GEMMs beat
the C++ op's per-row dot products once the quadratic part dominates (at 128 tokens they tie,
at 512 SDPA is 1.5x faster; decodes and short chunks are 1.2-5x faster in C++)."""


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    query_start_loc: torch.Tensor, scale: float, window: int | None = None,
                    workspace: object = None, *, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """paged_attention.paged_attention's signature; `workspace` is not needed (no gather)."""
    out = op("paged_attention")(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale, window or 0, LONG_CHUNK - 1, softcap or 0.0, sinks)
    if q.shape[0] - seq_lens.shape[0] + 1 >= LONG_CHUNK:  # some chunk may be long
        starts, lens = query_start_loc.tolist(), seq_lens.tolist()
        for i, seq_len in enumerate(lens):
            q_len = starts[i + 1] - starts[i]
            if q_len >= LONG_CHUNK:
                prefill_chunk(q, k_cache, v_cache, block_tables[i], seq_len, starts[i], q_len,
                             scale, window, out, softcap, sinks)
    return out


def reshape_and_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    op("reshape_and_cache")(k, v, k_cache, v_cache, slot_mapping)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """rms_norm.rms_norm's contract: (norm(x + residual), x + residual) with a residual."""
    if residual is None:
        return op("rms_norm")(x, weight, eps)
    return op("fused_add_rms_norm")(x, residual, weight, eps)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary.apply_rotary's contract (q [T, H, D], k [T, Hk, D]; new tensors)."""
    return op("apply_rotary")(q, k, positions, cos_sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2 * inter] -> SiLU(gate) * up, [..., inter]: torch's kernels in one call (the same
    bits as the chunk / silu / mul chain, layers/activation.py)."""
    return op("silu_and_mul")(x)


GEMV_MAX_ROWS = 2
"""`gemv` takes up to this many rows (from three oneDNN's packed GEMM was faster; the Linears now
run `panel_matmul` instead, faster at one row too: docs/figures.md "dense16")."""


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [M <= GEMV_MAX_ROWS, K] @ weight [N, K]^T + bias, all float32, weight contiguous."""
    return op("gemv")(x, weight, bias)


Q8_MAX_ROWS = 16
"""GGUF layers without a kept bf16 copy (gguf_weights.KEPT_FROM_ROWS) run steps of fewer rows
than this through the int8-activation kernel (`gguf_matmul_q8`, csrc/cpu_gguf.cpp) where it is
built: at 8 rows it was 1.3-1.7x the
dequantise + bf16 GEMM path, level at 16, 0.7-0.8x at 32 (benchmarks/gguf_kernels.py, one
thread, 4096 x 2048): per row it spends four vector ops on 64 weights (dot, convert, two
scalings), a bf16 GEMM two."""

Q8K_TYPES = frozenset({12, 14})
"""ggml types (Q4_K, Q6_K) with `gguf_matmul_q8k`: activations quantised per 256 and each
super-block's sub-block scales applied in integers (llama.cpp's Q8_K way), one float FMA a
super-block instead of one a 64 weights: at one row 2.1x (Q4_K) and 2.5x (Q6_K) the per-32
kernel, 1.1x / 1.4x at 8 rows, 0.9x / 1.6x at 15 (benchmarks/gguf_kernels.py, one thread)."""
Q8K_MAX_ROWS = 8
"""Steps of up to this many rows of a Q8K_TYPES weight run `gguf_matmul_q8k`."""


def q8k_available(ggml_type: int) -> bool:
    """Whether `gguf_matmul_q8k` is built (AVX-512 VNNI) and runs `ggml_type`."""
    return ggml_type in Q8K_TYPES and load() and hasattr(torch.ops.shoal_cpu, "gguf_matmul_q8k")


PACKED_TYPES = frozenset({12, 14, 8, 3})
"""ggml types (Q4_K, Q6_K, Q8_0, Q4_1) that GGUF layers repack once at load into 16 rows
interleaved (`gguf_repack`, csrc/cpu_gguf.cpp) and run below Q8_MAX_ROWS rows as
`gguf_matmul_packed`: each int8 dot-product lane is one output row, a (sub-)block's scale is
applied once per 16 or 32 weights, 16 rows' results come out as one vector
(benchmarks/gguf_kernels.py, docs/figures.md). The activations are quantised per 256, or per 32
(Q4_1 always, Q8_0 where `in_features` is no multiple of 256: SmolLM2's LM head), so
`in_features` must be a multiple of that."""


def packed_available(ggml_type: int, in_features: int) -> bool:
    """Whether a `ggml_type` weight of `in_features` columns is repacked at load."""
    multiple = 32 if ggml_type in (3, 8) else 256
    return (ggml_type in PACKED_TYPES and in_features % multiple == 0 and load()
            and hasattr(torch.ops.shoal_cpu, "gguf_repack"))


Q8_INT8_MAX_ROWS = 1
"""Shoal's int8 layers run steps of up to this many rows through `int8_matmul_q8`: 1.5x
`torch._weight_int8pack_mm` at one row, level at two."""


def q8_available(in_features: int) -> bool:
    """Whether the int8-activation VNNI kernels are built (AVX-512 VNNI under -march=native)
    and take rows of `in_features` (a multiple of 64)."""
    return in_features % 64 == 0 and load() and hasattr(torch.ops.shoal_cpu, "gguf_matmul_q8")


MOE_MAX_ROWS = 64
"""Steps of up to this many tokens run a whole MoE layer as `moe_forward`; larger ones sort the
tokens by expert and run each expert's oneDNN GEMM (layers/moe.py). Over the packed panels, one
thread, 4-12 layers of 8 experts of 768, top-2 (benchmarks/moe_layer.py, a loaded machine, load
2-4): 0.47-0.6x the per-expert path's time at 1-64 rows, 0.8x at 128, 0.76-0.86x at 256-512;
64 keeps prefill chunks on oneDNN until 2 threads are measured on a quiet machine."""


def moe_pack(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert stacks w13 [E, 2I, K] (gate rows, then up rows) and w2 [E, H, I], float32 ->
    `moe_forward`'s panels (csrc/cpu_moe.cpp): w13 [E, ceil(I / 16), K, 32], panel b's lanes 0-15
    gate rows 16b.., lanes 16-31 the same up rows; w2 [E, ceil(H / 32), I, 32]; k-major, rows
    past I / H zero. The same bytes (plus that padding): it replaces the plain stacks."""
    e, i2, k = w13.shape
    inter, hidden = i2 // 2, w2.shape[1]
    nb1, nb2 = -(-inter // 16), -(-hidden // 32)
    gate, up = (F.pad(half.float(), (0, 0, 0, nb1 * 16 - inter)).view(e, nb1, 16, k)
                for half in w13.split(inter, dim=1))
    w13p = torch.cat([gate, up], dim=2).transpose(2, 3).contiguous()
    w2p = F.pad(w2.float(), (0, 0, 0, nb2 * 32 - hidden)).view(e, nb2, 32, inter)
    return w13p, w2p.transpose(2, 3).contiguous()


def moe_forward(x: torch.Tensor, router_w: torch.Tensor, router_b: torch.Tensor | None,
                w13: torch.Tensor, b13: torch.Tensor | None, w2: torch.Tensor,
                b2: torch.Tensor | None, top_k: int, renormalize: bool,
                swiglu: tuple[float, float] | None = None) -> torch.Tensor:
    """A whole MoE layer's experts, float32: x [T, K], router [E, K] (+ [E]), w13 / w2 the
    stacks packed by `moe_pack` (+ biases [E, 2I] gate then up, [E, K]) -> [T, K], the routed
    experts' outputs scaled by their weights and summed. `renormalize`: softmax over the top-k
    logits (gpt-oss's top-k-first too), else the top-k of the full softmax. `swiglu` (alpha,
    limit): gpt-oss's clamped SwiGLU instead of SiLU(gate) * up."""
    alpha, limit = swiglu or (0.0, 0.0)
    return op("moe_forward")(x, router_w, router_b, w13, b13, w2, b2, top_k, renormalize,
                             0 if swiglu is None else 1, alpha, limit)


PANEL_MAX_ROWS = 32
"""fp32 Linears run steps of up to this many tokens through `panel_matmul` over their weight
packed by `dense_pack`; from there oneDNN's packed GEMM (docs/figures.md "dense16")."""


def dense_pack(weight: torch.Tensor) -> torch.Tensor:
    """A Linear's weight [N, K] -> `panel_matmul`'s [ceil(N / 32), K, 32] float32: k-major panels
    of 32 output rows, rows past N zero (`moe_pack`'s w2 layout for one expert). The same bytes
    plus that padding: it replaces the plain copy the GEMV read."""
    n, k = weight.shape
    nb = -(-n // 32)
    padded = F.pad(weight.detach().float(), (0, 0, 0, nb * 32 - n))
    return padded.view(nb, 32, k).transpose(1, 2).contiguous()


def panel_matmul(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                 n: int) -> torch.Tensor:
    """x [M, K] @ W^T + bias -> [M, n] float32, W [n, K] packed by `dense_pack`."""
    return op("panel_matmul")(x, packed, bias, n)
