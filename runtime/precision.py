"""Compute precisions: how a network's weight products are multiplied.

- "float32": operands as stored (the default; float64 networks multiply in float64).
- "bfloat16": both operands of every product with a weight rounded to bfloat16 (8 significant
  bits, float32's range), products accumulated in float32; activations, cell states, biases and
  everything else stay float32. The CPU backend multiplies with MKL's packed bfloat16 GEMM (AMX
  or AVX512-BF16 where the CPU has them) on Intel, with lamina's bfloat16 panels on other CPUs
  with AVX512-BF16; a backend without either computes the same values as float32 products of
  the rounded operands.
- "int8": dynamic quantization. Each weight is held as int8 per output channel (symmetric: the
  channel's largest magnitude is 127 steps of its scale); each row of the activations is
  quantized when the product runs, asymmetrically with a zero point (the row's range, widened to
  hold 0, in ACTIVATION_LEVELS steps), and the products are summed in int32 and scaled back to
  float32. The CPU backend multiplies with MKL's packed u8 x s8 GEMM (AMX or AVX512-VNNI where the
  CPU has them); a backend without one computes the same values as float32 products of the
  quantized integers. Everything else stays float32.

numpy has no bfloat16 type: bfloat16 data is kept as uint16 arrays of its bits (the upper half
of a float32's), converted here.
"""
from __future__ import annotations

import numpy as np

PRECISIONS = ("float32", "bfloat16", "int8")
# quantization steps: a weight channel's magnitude in +-WEIGHT_LEVELS, an activation row's range in
# ACTIVATION_LEVELS (u8 with a zero point)
WEIGHT_LEVELS = 127
ACTIVATION_LEVELS = 255


def check_precision(precision: str, where: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"{where}: precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
    return precision


def product_precision(precision: str) -> str:
    """The precision in which a run of `precision` multiplies where a product has no int8 form (a
    selective layer's selected dots, a convolution's GEMMs, autocast's backward): bfloat16 in a
    bfloat16 run, else float32 (an int8 network's convolutions multiply float32 activations by the
    weights' dequantized values)."""
    return "bfloat16" if precision == "bfloat16" else "float32"


def check_int8_pack(precision: str, b, trans: bool) -> None:
    """An int8 pack quantizes per output channel, b's rows: it takes b as [n, k] with trans."""
    if precision == "int8" and not trans:
        raise ValueError(f"pack: int8 products quantize the weight per output channel, its rows: b must be "
                         f"[out, in] with trans=True, found trans=False and shape {tuple(b.shape)}")
    if precision != "float32" and b.dtype != np.float32:
        raise TypeError(f"pack: {precision} products take float32 weights, found {b.dtype}")


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


def quantize_rows(x: np.ndarray, levels: int, symmetric: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Each row of x (2-D, float32) as integers times the row's scale: (q, scales), q float32.
    symmetric: scale = the row's largest magnitude / levels, q in [-levels, levels]. Otherwise the
    row's range widened to hold 0, [lo, hi], is `levels` steps: scale = (hi - lo) / levels, the
    zero point z = round(-lo / scale), and q = clip(round(x / scale) + z, 0, levels) - z (the u8
    value less its zero point). An all-zero row has scale 0 and q 0; a row holding NaN or infinity
    has scale NaN and q 0, so its products are NaN. Rounding is to nearest, ties to even, all in
    float32: every backend's kernel computes these same values."""
    x = np.asarray(x, dtype=np.float32)
    f32 = np.float32
    finite = np.isfinite(x).all(axis=1)
    x = np.where(np.isfinite(x), x, f32(0))  # (the scale says NaN below)
    if symmetric:
        scale = (np.abs(x).max(axis=1, initial=0) / f32(levels)).astype(f32)
    else:
        lo = np.minimum(x.min(axis=1, initial=0), f32(0))
        hi = np.maximum(x.max(axis=1, initial=0), f32(0))
        scale = ((hi - lo) / f32(levels)).astype(f32)
    safe = np.where(scale > 0, scale, f32(1))[:, None]
    scale = np.where(finite, scale, f32(np.nan)).astype(f32)
    with np.errstate(invalid="ignore"):
        steps = np.rint(x / safe)
        if symmetric:
            q = np.clip(steps, -levels, levels)
        else:
            zero = np.rint(-lo / safe[:, 0])[:, None]
            q = np.clip(steps + zero, 0, levels) - zero
    with np.errstate(invalid="ignore"):
        q = np.where(scale[:, None] > 0, q, f32(0)).astype(f32)
    return q, scale


def quantize_weight(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A weight [out, in...] as int8 per output channel (its first axis): (q int8, scales float32),
    w ~ q * scales[:, None]."""
    w = np.asarray(w, dtype=np.float32)
    q, scale = quantize_rows(w.reshape(w.shape[0], -1), WEIGHT_LEVELS, symmetric=True)
    return q.astype(np.int8).reshape(w.shape), scale


def dequantize_weight(q: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 values of an int8 weight quantized per output channel (quantize_weight)."""
    q = np.asarray(q)
    return (q.reshape(q.shape[0], -1).astype(np.float32) * np.asarray(scales, np.float32)[:, None]).reshape(q.shape)


def round_to_precision(w: np.ndarray, precision: str) -> np.ndarray:
    """The float32 values a weight has when stored in `precision` (float32: itself)."""
    if precision == "bfloat16":
        return round_bfloat16(w)
    if precision == "int8":
        return dequantize_weight(*quantize_weight(w))
    return np.asarray(w, dtype=np.float32)
