"""MXFP4 expert weights (gpt-oss as OpenAI ships it), dequantised once at load.

A checkpoint stores each stacked expert projection as two tensors: `<proj>_blocks`
[experts, rows, cols / 32, 16] uint8, two 4-bit E2M1 values a byte (the low nibble first), and
`<proj>_scales` [experts, rows, cols / 32] uint8, one power-of-two exponent (biased by 127) per
block of 32 values along the input dimension (the OCP microscaling format). Rows are the
projection's outputs, so a dequantised tensor is [experts, out, in]: our stacked experts' own
layout (transformers transposes it to its [experts, in, out] parameters).

Why dequantise rather than run MXFP4 matmuls: the CPU has no MXFP4 kernel here; the experts then
run as the bf16 layout's do (and may be requantised to int8 / int4 like any other weights).
"""

from __future__ import annotations

import torch

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
            -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The 16 values of a 4-bit E2M1 code (sign bit, two exponent bits, one mantissa bit)."""
BLOCK = 32
"""Values that share one scale."""
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., rows, cols / 32, 16] uint8 and scales [..., rows, cols / 32] uint8 ->
    [..., rows, cols] of `dtype` (exact in float32 and bfloat16: 2 significant bits)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (blocks of {BLOCK} values, 16 bytes each)")
    lut = torch.tensor(FP4_E2M1, dtype=torch.float32)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).long()  # [..., G, 16, 2]: lo, hi
    values = lut[codes].flatten(-2)  # [..., G, 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(values, exponents.unsqueeze(-1).float())
    return values.flatten(-2).to(dtype)  # [..., rows, cols]

