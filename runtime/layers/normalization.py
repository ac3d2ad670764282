"""Normalization over each row's features: LayerNorm and RMSNorm."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

import numpy as np

from .base import Layer, constant, register, require_float


class _RowNorm(Layer):
    """Normalises the last len(normalized_shape) axes of each sample (or sequence row), then
    scales by weight and shifts by bias where it has them (PyTorch's names and shapes)."""

    center = True

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float], elementwise_affine: bool,
                 bias: bool, name: Optional[str]) -> None:
        super().__init__(name)
        shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
        self.normalized_shape = tuple(int(s) for s in shape)
        if not self.normalized_shape or min(self.normalized_shape) < 1:
            raise ValueError(f"{type(self).__name__}: normalized_shape must be positive sizes, found {normalized_shape}")
        if eps is not None and not (math.isfinite(eps) and eps > 0):
            raise ValueError(f"{type(self).__name__}: eps must be a positive number, found {eps}")
        self.eps, self.elementwise_affine = eps, bool(elementwise_affine)
        self.with_bias = bool(bias)
        self.has_bias = self.elementwise_affine and self.with_bias
        if self.elementwise_affine:
            self.add_param("weight", constant(1.0, self.normalized_shape))
        if self.has_bias:
            self.add_param("bias", constant(0.0, self.normalized_shape))

    @property
    def features(self):
        return math.prod(self.normalized_shape)

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        k = len(self.normalized_shape)
        if tuple(x.shape[len(x.shape) - k:]) != self.normalized_shape:
            raise ValueError(f"input 0 must end in axes {list(self.normalized_shape)} (normalized_shape), found {x}")
        return x

    def _buffer(self, name):
        p = self.params.get(name)
        return None if p is None else p.buffer.reshape(self.features)

    def _eps(self, dtype):
        """PyTorch's RMSNorm takes the machine epsilon of the input's type when eps is None."""
        return float(np.finfo(dtype).eps) if self.eps is None else self.eps

    def _arrays(self, ctx, what):
        x = ctx.inputs[0]
        rows = x.size // self.features
        return (x.reshape(rows, self.features), what.reshape(rows, self.features), ctx.workspace("mean", (rows,)),
                ctx.workspace("rstd", (rows,)))

    def forward(self, ctx):
        x, y, mean, rstd = self._arrays(ctx, ctx.output)
        ctx.be.layer_norm(x, self._buffer("weight"), self._buffer("bias"), self._eps(x.dtype), y, mean, rstd,
                          self.center)

    def backward(self, ctx):
        x, dy, mean, rstd = self._arrays(ctx, ctx.grad_output)
        dx = ctx.input_grad(0)
        dw = ctx.param_grad("weight") if self.elementwise_affine else None
        db = ctx.param_grad("bias") if self.has_bias else None
        flat = lambda target: None if target is None else target.array.reshape(-1)  # noqa: E731
        ctx.be.layer_norm_backward(x, dy, mean, rstd, self._buffer("weight"),
                                   None if dx is None else dx.array.reshape(x.shape), 0.0 if dx is None else dx.beta,
                                   flat(dw), 0.0 if dw is None else dw.beta, flat(db), 0.0 if db is None else db.beta,
                                   self.center)

    def config(self):
        return {"normalized_shape": list(self.normalized_shape), "eps": self.eps,
                "elementwise_affine": self.elementwise_affine}


@register
class LayerNorm(_RowNorm):
    """y = (x - mean) / sqrt(var + eps) * weight + bias over the trailing normalized_shape axes,
    var the biased variance (torch.nn.LayerNorm)."""

    kind = "layer_norm"

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: float = 1e-5, elementwise_affine: bool = True,
                 bias: bool = True, name: Optional[str] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, bias, name)

    def config(self):
        return {**super().config(), "bias": self.with_bias}


@register
class RMSNorm(_RowNorm):
    """y = x / sqrt(mean(x²) + eps) * weight over the trailing normalized_shape axes
    (torch.nn.RMSNorm; eps None: the machine epsilon of the network's float type)."""

    kind = "rms_norm"
    center = False

    def __init__(self, normalized_shape: Union[int, Sequence[int]], eps: Optional[float] = None,
                 elementwise_affine: bool = True, name: Optional[str] = None) -> None:
        super().__init__(normalized_shape, eps, elementwise_affine, False, name)
