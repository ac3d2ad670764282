"""Compute precisions: how a network's weight products are multiplied.

- "float32": operands as stored (the default; float64 networks multiply in float64).
- "bfloat16": both operands of every product with a weight rounded to bfloat16 (8 significant
  bits, float32's range), products accumulated in float32; activations, cell states, biases and
  everything else stay float32. The CPU backend multiplies with MKL's packed bfloat16 GEMM (AMX
  or AVX512-BF16 where the CPU has them); a backend without one computes the same values as
  float32 products of the rounded operands.

numpy has no bfloat16 type: bfloat16 data is kept as uint16 arrays of its bits (the upper half
of a float32's), converted here.
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("float32", "bfloat16")


def check_precision(precision: str, where: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
    return precision


def bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """The bfloat16 nearest to each float32 of x (ties to even) as uint16 bits; NaN stays NaN."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = ((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)).astype(np.uint16)
    nan = (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
    return np.where(nan, ((u >> np.uint32(16)) | np.uint32(0x40)).astype(np.uint16), rounded)


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    """float32 values of bfloat16 bits."""
    return (np.asarray(bits, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def round_bfloat16(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest bfloat16 values, as float32."""
    return from_bfloat16_bits(bfloat16_bits(x))
