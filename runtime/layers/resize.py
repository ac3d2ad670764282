"""Layers that resample a sample's axes one at a time: Resize (upsampling in segmentation heads,
U-Nets and super-resolution; ONNX's Resize and Upsample, torch.nn.functional.interpolate), Pad
(zeros, edge, reflection or wrap-around; negative amounts crop; ONNX's Pad, torch's F.pad) and
Reduce (the sum or mean over axes, kept with size 1: each output reads every input of its axis).

Each is separable: every axis it changes is resampled in turn, by a table of input taps and
weights per output position (`resampling_table`, `padding_table`) that the backend's
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


PAD_MODES = ("constant", "edge", "reflect", "wrap")


def padding_table(n_in, before, after, mode):
    """(taps, weights) of one axis padded by `before` and `after` positions (negative: cropped):
    output j reads input j - before, or for a position outside the input its edge, its reflection
    about the edge (the edge not repeated) or its wrap-around; "constant" reads nothing there
    (weight 0: zeros)."""
    src = np.arange(n_in + before + after) - before
    inside = (src >= 0) & (src < n_in)
    if mode == "edge":
        src = np.clip(src, 0, n_in - 1)
    elif mode == "wrap":
        src = src % n_in
    elif mode == "reflect":
        period = 2 * (n_in - 1)
        src = np.abs(src) % period if period else np.zeros_like(src)
        src = np.where(src >= n_in, period - src, src)
    weights = np.ones(len(src)) if mode != "constant" else inside.astype(np.float64)
    return np.where(inside | (mode != "constant"), src, 0).astype(np.int32)[:, None], weights[:, None]


class _Resampling(Layer):
    """A layer that resamples some of a sample's axes, each by a table (see the module docstring):
    subclasses set `_tables` in output_spec, one per sample axis: None where the axis is kept, else
    (taps, {dtype: weights}, size out)."""

    _tables: Optional[list] = None

    @staticmethod
    def _table(taps, weights, n_out):
        return taps, {np.dtype(t): weights.astype(t) for t in (np.float32, np.float64)}, n_out

    def _steps(self, shape):
        """(axis, outer, n_in, n_out, inner, taps, weights) for each resampled axis of a batch of
        the given shape [N, *sample]."""
        current = list(shape)
        for axis, table in enumerate(self._tables or ()):
            if table is None:
                continue
            k = axis + 1
            taps, weights, n_out = table
            yield axis, math.prod(current[:k]), current[k], n_out, math.prod(current[k + 1:]), taps, weights
            current[k] = n_out

    def forward(self, ctx):
        x, y = ctx.inputs[0], ctx.output
        steps = list(self._steps(x.shape))
        if not steps:
            ctx.be.copy(x, y)
            return
        for i, (axis, outer, n_in, n_out, inner, taps, weights) in enumerate(steps):
            out = y if i == len(steps) - 1 else ctx.workspace(("resampled", axis), (outer, n_out, inner))
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
            target = dx.array if first else ctx.workspace(("resampled grad", axis), (outer, n_in, inner))
            ctx.be.resample_axis_backward(dy.reshape(outer, n_out, inner), taps, weights[np.dtype(dy.dtype)],
                                          target.reshape(outer, n_in, inner), dx.beta if first else 0.0)
            dy = target


@register
class Pad(_Resampling):
    """y = x padded along a sample's axes: `pads` one (before, after) pair per sample axis
    (negative: that many positions cropped), mode one of PAD_MODES ("constant" pads with zeros).
    Reflection needs more than `pad` values along its axis, as in ONNX and PyTorch."""

    kind = "pad"

    def __init__(self, pads: Sequence[Sequence[int]], mode: str = "constant", name: Optional[str] = None) -> None:
        super().__init__(name)
        self.pads = tuple((int(b), int(a)) for b, a in pads)
        if mode not in PAD_MODES:
            raise ValueError(f"Pad: mode must be one of {', '.join(PAD_MODES)}, found {mode!r}")
        self.mode = mode

    def config(self):
        return {"pads": [list(p) for p in self.pads], "mode": self.mode}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if len(self.pads) != len(x.shape):
            raise ValueError(f"input 0 must have {len(self.pads)} axes per sample (one per pair of pads), found {x}")
        tables, shape = [], []
        for axis, (n, (before, after)) in enumerate(zip(x.shape, self.pads)):
            size = n + before + after
            if size < 1:
                raise ValueError(f"pads {before}, {after} leave nothing of axis {axis} (size {n})")
            if self.mode == "reflect" and max(before, after) >= n:
                raise ValueError(f"reflect pads {before}, {after} of axis {axis} need more than that many values, "
                                 f"found {n}")
            if self.mode in ("edge", "reflect", "wrap") and n < 1:
                raise ValueError(f"{self.mode} padding of an empty axis {axis}")
            shape.append(size)
            tables.append(None if before == after == 0 else self._table(*padding_table(n, before, after, self.mode),
                                                                      size))
        self._tables = tables
        return Spec(tuple(shape), sequence=x.sequence)


@register
class Reduce(_Resampling):
    """y = the sum or mean of x over some of a sample's axes (`axes`, numbered within a sample),
    each kept with size 1 (torch's x.sum(dims, keepdim=True); reshape to drop them)."""

    kind = "reduce"

    def __init__(self, axes: Sequence[int], mode: str = "mean", name: Optional[str] = None) -> None:
        super().__init__(name)
        self.axes = tuple(sorted(int(a) for a in axes))
        if mode not in ("sum", "mean") or not self.axes or len(set(self.axes)) != len(self.axes) or self.axes[0] < 0:
            raise ValueError(f"Reduce: mode 'sum' or 'mean' over distinct axes, found {mode!r}, {list(axes)}")
        self.mode = mode

    def config(self):
        return {"axes": list(self.axes), "mode": self.mode}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if self.axes[-1] >= len(x.shape):
            raise ValueError(f"axes {list(self.axes)} of a sample of {len(x.shape)} axes, found {x}")
        self._tables = [None if axis not in self.axes else
                        self._table(np.arange(n, dtype=np.int32)[None, :],
                                    np.full((1, n), 1.0 / n if self.mode == "mean" else 1.0), 1)
                        for axis, n in enumerate(x.shape)]
        return Spec(tuple(1 if axis in self.axes else n for axis, n in enumerate(x.shape)), sequence=x.sequence)


@register
class Resize(_Resampling):
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

    def config(self):
        return {"size": list(self.size), "mode": self.mode, "coordinates": self.coordinates,
                "rounding": self.rounding, "scales": None if self.scales is None else list(self.scales)}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if x.sequence or len(x.shape) != len(self.size) + 1:
            raise ValueError(f"input 0 must be [C, *spatial] with {len(self.size)} spatial axes, found {x}")
        self._tables = [None]  # (the channels are kept)
        for axis, (n_in, n_out) in enumerate(zip(x.shape[1:], self.size)):
            scale = self.scales[axis] if self.scales is not None else n_out / n_in
            taps, weights = resampling_table(n_in, n_out, scale, self.mode, self.coordinates, self.rounding)
            identity = n_in == n_out and np.array_equal(taps[:, 0], np.arange(n_in)) and np.all(weights[:, 0] == 1)
            self._tables.append(None if identity else self._table(taps, weights, n_out))
        return Spec((x.shape[0],) + self.size)
