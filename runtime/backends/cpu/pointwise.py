"""The CPU's pointwise convolution (kernel 1, stride 1, no padding, one group): y = act(W x + b)
per sample, W [out, in] times the sample's input [in, positions] as panel tiles read from the
input itself, each tile stored with its bias and ReLU (or ReLU capped, as ReLU6) applied
(pyx/panels_impl.h pointwise_conv). The column path ran the same product as an OpenBLAS GEMM
into y preset to the bias and then an activation pass: three passes over y, and OpenBLAS's
packing of both operands for products only 16-160 deep (MobileNet-V2's)."""
import math

from .compiled import _kernels
from .. import columns
from ...threads import free_threads, split_work


def applies(geom):
    """Kernel 1, stride 1, no padding (the input is the column matrix), one group."""
    return (not geom.transposed and geom.groups == 1 and max(geom.kernel_size + geom.stride) == 1
            and max(geom.padding + geom.padding_end) == 0)


def forward(geom, weight, ctx, bias=None, relu=False, cap=math.inf):
    """y = conv(x) + bias, through a ReLU capped at `cap` where relu is set; a sample of fewer
    positions than one panel runs on columns."""
    be, x, y = ctx.be, ctx.inputs[0], ctx.output
    n, positions = x.shape[0], math.prod(x.shape[2:])
    if positions < _kernels.pointwise_min_positions(x.dtype.itemsize):
        columns.forward(geom, weight, ctx, bias=bias)
        if relu:
            be.activate_in_place(("relu", 0.0) if cap == math.inf else ("bounded_relu", cap), y)
        return
    w = weight.buffer.reshape(geom.out_channels, geom.in_channels)
    act = 0 if not relu else 1 if cap == math.inf else 2
    xs, ys = x.reshape(n, geom.in_channels, positions), y.reshape(n, geom.out_channels, positions)
    team = free_threads() if n == 1 else 1  # (a lone sample's positions shared by the team)

    def samples(t, items):
        for i in items:
            _kernels.pointwise_conv(w, xs[i], ys[i], bias, act, cap if act == 2 else 0.0, team)
    if team > 1:
        samples(0, range(n))
    else:
        split_work(n, samples, columns.threads(ctx))
