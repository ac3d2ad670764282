"""Resizing a sample's spatial axes (upsampling in segmentation heads, U-Nets and super-resolution;
ONNX's Resize and Upsample, torch.nn.functional.interpolate).

Nearest and (bi/tri)linear resampling are separable: each spatial axis is resampled in turn, as a
table of input taps and weights per output position (`resampling_table`) that the backend's
resample_axis kernel applies, and its adjoint resample_axis_backward takes back."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..graph import Spec
from .base import Layer, register, require_float

MODES = ("nearest", "linear")
# how an output position maps to an input coordinate (ONNX's coordinate_transformation_mode)
COORDINATES = ("half_pixel", "pytorch_half_pixel", "align_corners", "asymmetric", "half_pixel_symmetric")
# how a nearest-neighbour coordinate rounds (ONNX's nearest_mode)
ROUNDINGS = ("round_prefer_floor", "round_prefer_ceil", "floor", "ceil")


def source_coordinates(n_in, n_out, scale, coordinates):
    """The input coordinate of each output position along one axis, in float64 (ONNX's formulas,
    where the resized length is n_in · scale, not rounded)."""
    j = np.arange(n_out, dtype=np.float64)
    resized = n_in * scale
    if coordinates == "align_corners":
        return j * ((n_in - 1) / (resized - 1)) if resized != 1 else np.zeros(n_out)
    if coordinates == "asymmetric":
        return j / scale
    if coordinates == "pytorch_half_pixel" and resized == 1:
        return np.full(n_out, -0.5)
    if coordinates == "half_pixel_symmetric":  # the resized grid centred on the input's centre
        return n_in / 2 * (1 - n_out / resized) + (j + 0.5) / scale - 0.5
    return (j + 0.5) / scale - 0.5


def resampling_table(n_in, n_out, scale, mode, coordinates, rounding):
    """(taps int32 [n_out, K], weights float64 [n_out, K]) for one axis: K = 1 for nearest, 2 for
    linear; coordinates outside [0, n_in - 1] read the edge (as ONNX's edge padding)."""
    x = source_coordinates(n_in, n_out, scale, coordinates)
    if mode == "nearest":
        below = np.floor(x)
        half = x - below == 0.5
        near = {"floor": below, "ceil": np.ceil(x),
                "round_prefer_floor": np.where(half, below, np.floor(x + 0.5)),
                "round_prefer_ceil": np.where(half, below + 1, np.floor(x + 0.5))}[rounding]
        return np.clip(near, 0, n_in - 1).astype(np.int32)[:, None], np.ones((n_out, 1))
    below = np.floor(x)
    frac = x - below
    taps = np.clip(np.stack([below, below + 1], axis=1), 0, n_in - 1).astype(np.int32)
    return taps, np.stack([1 - frac, frac], axis=1)


@register
class Resize(Layer):
    """y = x resampled to `size` over the spatial axes of [C, *spatial] (1 to 3 of them): mode
    "nearest" or "linear" (bilinear, trilinear), `coordinates` one of COORDINATES, `rounding`
    (nearest only) one of ROUNDINGS. `scales` (one per spatial axis) gives the coordinate map
    where a model gave scales rather than sizes; by default it is size / input size."""

    kind = "resize"

    def __init__(self, size: Sequence[int], mode: str = "nearest", coordinates: str = "half_pixel",
                 rounding: str = "round_prefer_floor", scales: Optional[Sequence[float]] = None,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        self.size = tuple(int(s) for s in size)
        if not 1 <= len(self.size) <= 3 or min(self.size) < 1:
            raise ValueError(f"Resize: size must be 1 to 3 spatial sizes of at least 1, found {list(size)}")
        for what, value, allowed in (("mode", mode, MODES), ("coordinates", coordinates, COORDINATES),
                                     ("rounding", rounding, ROUNDINGS)):
            if value not in allowed:
                raise ValueError(f"Resize: {what} must be one of {', '.join(allowed)}, found {value!r}")
        self.mode, self.coordinates, self.rounding = mode, coordinates, rounding
        self.scales = None if scales is None else tuple(float(s) for s in scales)
        if self.scales is not None and (len(self.scales) != len(self.size) or
                                        not all(math.isfinite(s) and s > 0 for s in self.scales)):
            raise ValueError(f"Resize: scales must be {len(self.size)} positive numbers, found {list(self.scales)}")
        self._tables = None  # per spatial axis: (taps, weights by dtype) or None where it is the identity

    def config(self):
        return {"size": list(self.size), "mode": self.mode, "coordinates": self.coordinates,
                "rounding": self.rounding, "scales": None if self.scales is None else list(self.scales)}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if x.sequence or len(x.shape) != len(self.size) + 1:
            raise ValueError(f"input 0 must be [C, *spatial] with {len(self.size)} spatial axes, found {x}")
        self._tables = []
        for axis, (n_in, n_out) in enumerate(zip(x.shape[1:], self.size)):
            scale = self.scales[axis] if self.scales is not None else n_out / n_in
            taps, weights = resampling_table(n_in, n_out, scale, self.mode, self.coordinates, self.rounding)
            identity = n_in == n_out and np.array_equal(taps[:, 0], np.arange(n_in)) and np.all(weights[:, 0] == 1)
            self._tables.append(None if identity else
                                (taps, {np.dtype(t): weights.astype(t) for t in (np.float32, np.float64)}))
        return Spec((x.shape[0],) + self.size)

    def _steps(self, shape):
        """(axis, outer, n_in, n_out, inner, taps, weights) for each resampled axis of a batch
        [N, C, *spatial] whose input spatial shape is shape[2:]."""
        current = list(shape)
        for axis, table in enumerate(self._tables):
            k = axis + 2
            if table is None:
                continue
            n_in, n_out = current[k], self.size[axis]
            yield (axis, math.prod(current[:k]), n_in, n_out, math.prod(current[k + 1:])) + table
            current[k] = n_out

    def forward(self, ctx):
        x, y = ctx.inputs[0], ctx.output
        steps = list(self._steps(x.shape))
        if not steps:
            ctx.be.copy(x, y)
            return
        for i, (axis, outer, n_in, n_out, inner, taps, weights) in enumerate(steps):
            out = y if i == len(steps) - 1 else ctx.workspace(("resized", axis), (outer, n_out, inner))
            ctx.be.resample_axis(x.reshape(outer, n_in, inner), taps, weights[np.dtype(y.dtype)],
                                 out.reshape(outer, n_out, inner))
            x = out

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is None:
            return
        steps = list(self._steps(ctx.inputs[0].shape))
        if not steps:
            ctx.be.axpby(1.0, ctx.grad_output, dx.beta, dx.array)
            return
        dy = ctx.grad_output
        for i, (axis, outer, n_in, n_out, inner, taps, weights) in reversed(list(enumerate(steps))):
            first = i == 0
            target = dx.array if first else ctx.workspace(("resized grad", axis), (outer, n_in, inner))
            ctx.be.resample_axis_backward(dy.reshape(outer, n_out, inner), taps, weights[np.dtype(dy.dtype)],
                                          target.reshape(outer, n_in, inner), dx.beta if first else 0.0)
            dy = target
