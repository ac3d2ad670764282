"""The CPU's depthwise convolution: groups = input channels (MobileNet's and EfficientNet's
depthwise layers, a channel multiplier allowed), where the column path would run one tiny GEMM
per channel. Each (sample, channel) plane is one task of the compiled kernels (or, for small
or strided images, each sample's block of 8 channels: by_channels); the forward adds
the bias and applies a ReLU or ReLU6 as it stores, the input gradient spreads dy back over each plane
(with beta) and the weight gradient sums each channel's taps over the batch."""
import math

import numpy as np

from .compiled import _kernels
from ...threads import get_num_threads
from ..columns import as_volumes


def applies(geom):
    """A plain convolution with one group per input channel and more than one channel."""
    return (not geom.transposed and geom.groups == geom.in_channels > 1
            and geom.out_channels % geom.groups == 0)


def _windows(geom):
    """(kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw): 2-D lifted to depth 1; the padding before
    each axis (the output grid already says how far past the end the windows reach)."""
    kernel, stride, padding, dilation, _ = geom.windows
    return (*kernel, *stride, *padding, *dilation)


def _taps(weight, geom):
    return weight.buffer.reshape(geom.out_channels, -1)


# Images with one output channel per input channel run by vectors of channels (8 channels at a
# time, channels-last inside the kernel, 3 x 3 windows with their taps held in registers) where
# strided or at most this many outputs a plane, else by planes (vectors along each plane's rows;
# larger planes were not measured). MobileNet-V2's depthwise layers at batch 1 on an AMD EPYC
# (Zen 4, the AVX-512 build), the kernel alone, calls alternating in one process, by planes' time
# over by channels': 1 thread 32x112² 1.48x, 144x56² 1.36x, 192x28² 1.62x, 384x14² 2.17x, 576x14²
# 2.28x, 960x7² 2.53x, stride 2 96x112² 1.76x, 144x56² 1.93x; 2 threads 32x112² 1.21x, 144x56²
# 1.41x, stride 2 96x112² 1.67x; in the network, 32x112² 1.56x on 1 thread and 1.33x on 2. (Before
# the taps in registers the 112² plane ran faster by planes at 2 threads, 0.89x.)
CHANNELS_MAX_PLANE = 1 << 14


def by_channels(geom, out_size):
    """Whether the forward runs by vectors of channels (depthwise_conv's by_channels)."""
    return (geom.out_channels == geom.in_channels and geom.nd == 2
            and (max(geom.stride) > 1 or math.prod(out_size) <= CHANNELS_MAX_PLANE))


def forward(geom, weight, ctx, bias=None, relu=False, cap=math.inf):
    """y = conv(x) + bias, through a ReLU capped at `cap` where relu is set (ReLU6: cap 6)."""
    x, y = as_volumes(ctx.inputs[0]), as_volumes(ctx.output)
    kernel, stride, _, dilation, _ = geom.windows
    size = _kernels.depthwise_scratch_size(*y.shape[3:], *kernel[1:], *stride[1:], *dilation[1:])
    scratch = ctx.be.scratch("depthwise planes", (get_num_threads(), size), y.dtype)
    _kernels.depthwise_conv(x, _taps(weight, geom), y, bias, relu, cap, scratch, *_windows(geom),
                            by_channels(geom, y.shape[2:]))


def backward(geom, weight, ctx):
    """The input gradient (where wanted) and the weight gradient (where wanted), each with its beta."""
    dy = as_volumes(ctx.grad_output)
    dx = ctx.input_grad(0)
    if dx is not None:
        _kernels.depthwise_conv_input_grad(dy, _taps(weight, geom), as_volumes(dx.array), dx.beta, *_windows(geom))
    dw = ctx.param_grad("weight")
    if dw is not None:
        taps = dw.array.reshape(geom.out_channels, -1)
        sums = ctx.workspace("depthwise weight sums", taps.shape, np.float64)
        _kernels.depthwise_conv_weight_grad(as_volumes(ctx.inputs[0]), dy, taps, sums, dw.beta, *_windows(geom))
