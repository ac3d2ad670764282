"""Companions of the convolutions for volumes (NCDHW) and images (NCHW): max and average
pooling, batch normalisation, and concatenation along channels."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..backends.base import ACTIVATIONS
from ..graph import Spec
from .base import Layer, constant, int_tuple, padding_pairs, register, require_float, require_volume
from ..types import Size


class _Pool(Layer):
    """padding: an int, one per axis, or (before, after) pairs; ceil_mode: windows that start
    inside the input (or the padding before it) but end past the padding after it still count,
    as PyTorch's and ONNX's ceil_mode (the output size rounds up); dilation: the step between a
    window's taps (a window spans (kernel_size - 1) · dilation + 1 positions)."""

    nd = 3

    def __init__(self, kernel_size: Size, stride: Optional[Size] = None, padding: Size = 0,
                 ceil_mode: bool = False, name: Optional[str] = None, dilation: Size = 1) -> None:
        super().__init__(name)
        where = type(self).__name__
        self.kernel_size = int_tuple(kernel_size, self.nd, f"{where}: kernel_size")
        self.stride = int_tuple(stride if stride is not None else kernel_size, self.nd, f"{where}: stride")
        self.dilation = int_tuple(dilation, self.nd, f"{where}: dilation")
        self.padding, self.padding_end = padding_pairs(padding, self.nd, f"{where}: padding")
        self.ceil_mode = bool(ceil_mode)
        if min(self.kernel_size + self.stride + self.dilation) < 1 or min(self.padding + self.padding_end) < 0:
            raise ValueError(f"{where}: kernel_size, stride and dilation must be at least 1, padding at least 0")
        if any(2 * p > k for p, k in zip(self.padding + self.padding_end, self.span * 2)):
            raise ValueError(f"{where}: padding must be at most half the kernel size"
                             f"{' (its span, dilated)' if max(self.dilation) > 1 else ''}, found padding "
                             f"{self._padding_config()} for kernel {self.kernel_size}"
                             f"{f' dilated {self.dilation}' if max(self.dilation) > 1 else ''}")

    @property
    def span(self):
        """The positions a window spans along each axis: (kernel_size - 1) · dilation + 1."""
        return tuple((k - 1) * d + 1 for k, d in zip(self.kernel_size, self.dilation))

    def _padding_config(self):
        if self.padding == self.padding_end:
            return list(self.padding)
        return [list(p) for p in zip(self.padding, self.padding_end)]

    def config(self):
        cfg = {"kernel_size": list(self.kernel_size), "stride": list(self.stride), "padding": self._padding_config()}
        if self.ceil_mode:
            cfg["ceil_mode"] = True
        if max(self.dilation) > 1:
            cfg["dilation"] = list(self.dilation)
        return cfg

    def _out_size(self, n, k, s, p, q):
        span = n + p + q - k
        out = (-(-span // s) if self.ceil_mode else span // s) + 1
        if self.ceil_mode and (out - 1) * s >= n + p:  # the last window would start past the input
            out -= 1
        return out

    def output_spec(self, specs):
        x = require_volume(specs[0], self.nd)
        out = tuple(self._out_size(n, k, s, p, q) for n, k, s, p, q in
                    zip(x.shape[1:], self.span, self.stride, self.padding, self.padding_end))
        if min(out) < 1:
            raise ValueError(f"the output would be empty: input size {x.shape[1:]} with kernel {self.kernel_size}")
        return Spec((x.shape[0],) + out)

    def _window(self):
        one, zero = (1,) * (3 - self.nd), (0,) * (3 - self.nd)
        window = one + self.kernel_size, one + self.stride, zero + self.padding
        return window + (one + self.dilation,) if max(self.dilation) > 1 else window


class _MaxPool(_Pool):
    """y = the maximum of each window (padding never wins, and of equal values the first in the
    window does). With return_indices, a second output (int32, y's shape, labelled 'indices')
    holds each maximum's position in its sample's channel plane of x, counted row-major from 0
    (PyTorch's return_indices)."""

    def __init__(self, kernel_size: Size, stride: Optional[Size] = None, padding: Size = 0,
                 ceil_mode: bool = False, name: Optional[str] = None, dilation: Size = 1,
                 return_indices: bool = False) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, name, dilation)
        self.return_indices = bool(return_indices)
        if self.return_indices:
            self.output_labels = ("", "indices")

    def config(self):
        return {**super().config(), "return_indices": True} if self.return_indices else super().config()

    def output_spec(self, specs):
        y = super().output_spec(specs)
        return (y, Spec(y.shape, kind="int32")) if self.return_indices else y

    def _argmax(self, ctx):
        y = ctx.output
        shape = (y.shape[0] * y.shape[1], int(math.prod(y.shape[2:])))
        return ctx.outputs[1].reshape(shape) if self.return_indices else ctx.workspace("argmax", shape, np.int32)

    def forward(self, ctx):
        # positions are for backward (or asked for): an inference run keeps none of its own
        wanted = ctx.training or self.return_indices
        ctx.be.max_pool(ctx.inputs[0], ctx.output, self._argmax(ctx) if wanted else None, self._window())

    def as_max_pool(self):
        # (a convolution pools undilated windows, and writes no positions)
        return self._window() if max(self.dilation) == 1 and not self.return_indices else None

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.max_pool_backward(ctx.grad_output, self._argmax(ctx), dx.array, dx.beta, self._window())


class _AvgPool(_Pool):
    """y = the mean of each window; count_include_pad says whether padded positions count."""

    def __init__(self, kernel_size: Size, stride: Optional[Size] = None, padding: Size = 0,
                 count_include_pad: bool = True, ceil_mode: bool = False, name: Optional[str] = None,
                 dilation: Size = 1) -> None:
        super().__init__(kernel_size, stride, padding, ceil_mode, name, dilation)
        self.count_include_pad = bool(count_include_pad)

    def config(self):
        return {**super().config(), "count_include_pad": self.count_include_pad}

    def output_spec(self, specs):
        out = super().output_spec(specs)
        if self.count_include_pad:
            # the kernels divide by the whole window: every window must end within the padding
            for n, o, k, s, p, q in zip(specs[0].shape[1:], out.shape[1:], self.span, self.stride,
                                        self.padding, self.padding_end):
                if (o - 1) * s + k > n + p + q:
                    raise ValueError(f"{type(self).__name__}: with count_include_pad, ceil_mode's last window "
                                     f"would reach past the padding (input {list(specs[0].shape[1:])}, kernel "
                                     f"{list(self.kernel_size)}, stride {list(self.stride)}); PyTorch divides it "
                                     f"by its part inside, which lamina does not")
        return out

    def forward(self, ctx):
        ctx.be.avg_pool(ctx.inputs[0], ctx.output, self._window(), self.count_include_pad)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.avg_pool_backward(ctx.grad_output, dx.array, self._window(), self.count_include_pad, dx.beta)


@register
class MaxPool3d(_MaxPool):
    kind = "max_pool3d"


@register
class MaxPool2d(_MaxPool):
    kind = "max_pool2d"
    nd = 2


@register
class AvgPool3d(_AvgPool):
    kind = "avg_pool3d"


@register
class AvgPool2d(_AvgPool):
    kind = "avg_pool2d"
    nd = 2


class _BatchNorm(Layer):
    """Training: y = (x - mean) / sqrt(var + eps) · weight + bias with the batch's per-channel
    statistics over N and space, and running averages updated as PyTorch does
    (r = (1 - momentum) r + momentum · stat, the variance unbiased). Inference: the running
    statistics. running_mean and running_var are saved with the model and never trained.
    frozen_statistics=True uses (and keeps) the running statistics in training too, as a PyTorch
    model fine-tuned in eval mode does: the layer is then a fixed per-channel affine map, and
    backward is that map's gradient."""

    nd = 3

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float = 0.1, affine: bool = True,
                 frozen_statistics: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.num_features, self.eps, self.momentum, self.affine = int(num_features), float(eps), float(momentum), bool(affine)
        self.frozen_statistics = bool(frozen_statistics)
        if self.num_features < 1 or self.eps <= 0 or not 0 <= self.momentum <= 1:
            raise ValueError(f"{type(self).__name__}: expected num_features >= 1, eps > 0, momentum in [0, 1]")
        if self.affine:
            self.add_param("weight", constant(1.0, (self.num_features,)))
            self.add_param("bias", constant(0.0, (self.num_features,)))
        for stat, value in (("running_mean", 0.0), ("running_var", 1.0)):
            self.add_param(stat, constant(value, (self.num_features,)), trainable=False)

    def config(self):
        return {"num_features": self.num_features, "eps": self.eps, "momentum": self.momentum, "affine": self.affine,
                "frozen_statistics": self.frozen_statistics}

    def _batch_statistics(self, ctx):
        return ctx.training and not self.frozen_statistics

    def output_spec(self, specs):
        x = require_volume(specs[0], self.nd)
        if x.shape[0] != self.num_features:
            raise ValueError(f"input 0 has {x.shape[0]} channels, expected num_features={self.num_features}")
        return x

    def _stat(self, ctx, key):
        """A workspace of C statistics, of the backend's statistics type."""
        return ctx.workspace(key, (self.num_features,), ctx.be.stat_dtype(ctx.inputs[0].dtype))

    def forward(self, ctx):
        be, x = ctx.be, ctx.inputs[0]
        mean, var, invstd = (self._stat(ctx, k) for k in ("mean", "var", "invstd"))
        running_mean, running_var = self.params["running_mean"], self.params["running_var"]
        batch = self._batch_statistics(ctx)
        if batch:
            be.batch_norm_stats(x, mean, var)
        be.batch_norm_statistics(mean, var, invstd, running_mean.buffer, running_var.buffer, self.eps,
                                 self.momentum, x.size // self.num_features, batch)
        if batch:
            running_mean.changed()
            running_var.changed()
        gamma = self.params["weight"].buffer if self.affine else None
        bias = self.params["bias"].buffer if self.affine else None
        be.batch_norm_apply(x, mean, invstd, gamma, bias, ctx.output, ctx.activation)

    def fuses_activation(self, kind):
        return kind in ACTIVATIONS

    def backward(self, ctx):
        be, x = ctx.be, ctx.inputs[0]
        mean, invstd, dgamma, dbeta = (self._stat(ctx, k) for k in ("mean", "invstd", "dgamma", "dbeta"))
        dx = ctx.input_grad(0)
        gamma = self.params["weight"].buffer if self.affine else None
        be.batch_norm_backward(x, ctx.grad_output, mean, invstd, gamma, self._batch_statistics(ctx),
                               dx.array if dx is not None else None, dx.beta if dx is not None else 0.0,
                               dgamma, dbeta)
        if self.affine:
            for name, value in (("weight", dgamma), ("bias", dbeta)):
                target = ctx.param_grad(name)
                if target is not None:
                    be.add_cast(value, target.array, target.beta)


@register
class BatchNorm3d(_BatchNorm):
    kind = "batch_norm3d"


@register
class BatchNorm2d(_BatchNorm):
    kind = "batch_norm2d"
    nd = 2


@register
class ConcatChannels(Layer):
    """y = [x_0, x_1, …] along the channel axis; inputs [C_i, *spatial] of one spatial size."""

    kind = "concat_channels"
    arity = (1, 64)

    def output_spec(self, specs):
        first = specs[0]
        require_float(first, "input 0")
        if first.sequence or len(first.shape) < 2:
            raise ValueError(f"input 0 must be [C, *spatial] per sample, found {first}")
        for i, s in enumerate(specs[1:], 1):
            require_float(s, f"input {i}")
            if s.sequence or s.shape[1:] != first.shape[1:]:
                raise ValueError(f"input {i} is {s}; every input needs the spatial size {list(first.shape[1:])}")
        return Spec((sum(s.shape[0] for s in specs),) + first.shape[1:])

    def _blocks(self, ctx):
        col = 0
        for x in ctx.inputs:
            flat = x.reshape(x.shape[0], -1)
            yield flat, col
            col += flat.shape[1]

    def forward(self, ctx):
        y = ctx.output.reshape(ctx.output.shape[0], -1)
        for flat, col in self._blocks(ctx):
            ctx.be.copy_to_columns(flat, y, col)

    def backward(self, ctx):
        dy = ctx.grad_output.reshape(ctx.grad_output.shape[0], -1)
        for i, (flat, col) in enumerate(self._blocks(ctx)):
            dx = ctx.input_grad(i)
            if dx is not None:
                ctx.be.copy_from_columns(dy, col, dx.array.reshape(flat.shape), dx.beta)
