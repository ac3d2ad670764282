"""Convolution and transposed convolution over 3-D volumes (NCDHW) and 2-D images (NCHW), with
PyTorch's arguments and weight layouts. The layer holds the geometry and the parameters; the
backend runs it (Backend.conv_forward / conv_backward), handed the layer's ConvGeometry and
weight, with the algorithm it picks by the geometry: vol2col + GEMM everywhere (lamina.backends.columns), faster kernels where a backend
has them (lamina.backends.cpu.conv_algorithms). A 2-D layer is the 3-D one with depth 1 (kernel
depth 1, stride 1, padding 0).
Output sizes follow PyTorch's formulas; an empty output or channels that groups do not divide
are errors naming the layer.
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..backends.base import ACTIVATIONS
from ..backends.geometry import ConvGeometry, output_sizes
from ..graph import Spec
from ..random import generator
from .base import Layer, int_tuple, padding_pairs, register, require_volume, uniform
from ..types import Size


class _ConvNd(Layer):
    nd = 3
    transposed = False

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Size, stride: Size = 1, padding: Size = 0,
                 dilation: Size = 1, groups: int = 1, bias: bool = True, output_padding: Size = 0,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        where = type(self).__name__
        nd = self.nd
        self.in_channels, self.out_channels, self.groups = int(in_channels), int(out_channels), int(groups)
        self.kernel_size = int_tuple(kernel_size, nd, f"{where}: kernel_size")
        self.stride = int_tuple(stride, nd, f"{where}: stride")
        # padding: before each axis; padding_end: after it (the same unless given as pairs)
        self.padding, self.padding_end = padding_pairs(padding, nd, f"{where}: padding")
        self.dilation = int_tuple(dilation, nd, f"{where}: dilation")
        self.output_padding = int_tuple(output_padding, nd, f"{where}: output_padding")
        self.has_bias = bool(bias)
        if min(self.in_channels, self.out_channels, self.groups) < 1:
            raise ValueError(f"{where}: channels and groups must be at least 1")
        if self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"{where}: in_channels ({self.in_channels}) and out_channels ({self.out_channels}) "
                             f"must both be divisible by groups ({self.groups})")
        if min(self.kernel_size + self.stride + self.dilation) < 1 or min(self.padding + self.padding_end) < 0:
            raise ValueError(f"{where}: kernel_size, stride and dilation must be at least 1 and padding at "
                             f"least 0, found {self.kernel_size}, {self.stride}, {self.dilation}, {self.padding}")
        if not self.transposed and any(self.output_padding):
            raise ValueError(f"{where}: output_padding is for transposed convolutions")
        for op, s, d in zip(self.output_padding, self.stride, self.dilation):
            if not 0 <= op < max(s, d):
                raise ValueError(f"{where}: output_padding must be smaller than stride or dilation, "
                                 f"found {self.output_padding} with stride {self.stride}, dilation {self.dilation}")
        k = int(math.prod(self.kernel_size))
        if self.transposed:
            shape = (self.in_channels, self.out_channels // self.groups) + self.kernel_size
        else:
            shape = (self.out_channels, self.in_channels // self.groups) + self.kernel_size
        bound = 1 / math.sqrt(shape[1] * k)  # PyTorch's default for both weight and bias
        rng = generator()
        self.add_param("weight", uniform(rng, bound, shape))
        if self.has_bias:
            self.add_param("bias", uniform(rng, bound, (self.out_channels,)))

    @property
    def weight(self):
        return self.params["weight"]

    @property
    def bias(self):
        return self.params.get("bias")

    def product_weights(self):
        return ("weight",)

    def config(self):
        cfg = {"in_channels": self.in_channels, "out_channels": self.out_channels,
               "kernel_size": list(self.kernel_size), "stride": list(self.stride),
               "padding": list(self.padding) if self.symmetric else [list(p) for p in zip(self.padding,
                                                                                            self.padding_end)],
               "dilation": list(self.dilation), "groups": self.groups,
               "bias": self.has_bias}
        if self.transposed:
            cfg["output_padding"] = list(self.output_padding)
        return cfg

    @property
    def symmetric(self):
        """Whether every axis is padded alike on both sides."""
        return self.padding == self.padding_end

    def _out_sizes(self, sizes):
        return output_sizes(self.transposed, sizes, self.kernel_size, self.stride, self.padding, self.padding_end,
                            self.dilation, self.output_padding)

    def geometry(self, in_size=None):
        """The ConvGeometry for an input grid (the one last validated when None), built once per
        input grid."""
        in_size = self._in_size if in_size is None else tuple(int(n) for n in in_size)
        cached = self.__dict__.get("_geometry")
        if cached is None or cached.in_size != in_size:
            cached = self._geometry = ConvGeometry(
                self.nd, self.transposed, self.in_channels, self.out_channels, self.groups, self.kernel_size,
                self.stride, self.padding, self.padding_end, self.dilation, self.output_padding, in_size,
                self._out_sizes(in_size))
        return cached

    def output_spec(self, specs):
        x = require_volume(specs[0], self.nd)
        if x.shape[0] != self.in_channels:
            raise ValueError(f"input 0 has {x.shape[0]} channels, expected in_channels={self.in_channels}")
        out = self._out_sizes(x.shape[1:])
        if min(out) < 1:
            raise ValueError(f"the output would be empty: input size {x.shape[1:]} gives {out} with kernel "
                             f"{self.kernel_size}, stride {self.stride}, padding {self.padding}, "
                             f"dilation {self.dilation}")
        self._in_size = tuple(x.shape[1:])
        return Spec((self.out_channels,) + out)

    def algorithms(self, backend, in_size=None):
        """{'forward', 'input grad', 'weight grad'}: the algorithm `backend` runs each with, for an
        input grid (the one last validated; where there is none, the kernel's own extent: the
        choice reads only the kernel's shape then)."""
        if in_size is None and "_in_size" not in self.__dict__:
            in_size = tuple(d * (k - 1) + 1 for k, d in zip(self.kernel_size, self.dilation))
        return backend.conv_algorithms(self.geometry(in_size))

    def forward(self, ctx):
        ctx.be.conv_forward(self.geometry(ctx.inputs[0].shape[2:]), self.weight, ctx,
                            self.bias.buffer if self.has_bias else None, ctx.activation, ctx.pool)

    def fuses_activation(self, kind):
        return kind in ACTIVATIONS

    def fuses_max_pool(self):
        return not self.transposed

    def backward(self, ctx):
        ctx.be.conv_backward(self.geometry(ctx.inputs[0].shape[2:]), self.weight, ctx)
        if self.has_bias:
            db = ctx.param_grad("bias")
            if db is not None:
                ctx.be.channel_bias_grad(ctx.grad_output, db.array, db.beta)


class _Conv(_ConvNd):
    """y = conv(x, W) + b (cross-correlation, as PyTorch)."""


class _ConvTranspose(_ConvNd):
    """The adjoint of a convolution: y = col2vol(Wᵀ x) + b, output size
    (n - 1)·stride - 2·padding + dilation·(k - 1) + output_padding + 1."""

    transposed = True


@register
class Conv3d(_Conv):
    kind = "conv3d"
    nd = 3

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Size, stride: Size = 1, padding: Size = 0,
                 dilation: Size = 1, groups: int = 1, bias: bool = True, name: Optional[str] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, name=name)


@register
class Conv2d(Conv3d):
    kind = "conv2d"
    nd = 2


@register
class ConvTranspose3d(_ConvTranspose):
    kind = "conv_transpose3d"
    nd = 3

    def __init__(self, in_channels: int, out_channels: int, kernel_size: Size, stride: Size = 1, padding: Size = 0,
                 output_padding: Size = 0, groups: int = 1, bias: bool = True, dilation: Size = 1,
                 name: Optional[str] = None) -> None:
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         output_padding, name=name)


@register
class ConvTranspose2d(ConvTranspose3d):
    kind = "conv_transpose2d"
    nd = 2
