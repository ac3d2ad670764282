"""The CPU's direct convolution (pyx/direct_conv.h), no column matrix: with unit stride along
the width and the same padding on both sides of every axis, the forward (4 output channels x 2
vectors of widths per register tile, weights packed in reading order, cached per weight
version); with unit strides everywhere the input gradient too (the convolution of dy with the
kernel flipped and its in/out channels swapped); the weight gradient by direct_conv_dw (kernel
width up to direct_conv_dw_max_width()). A width stride s > 1 runs as s unit-stride direct
convolutions, one per width phase of the input (width phases)."""
import numpy as np

from .compiled import _kernels
from .. import columns
from ..columns import as_volume
from .aligned import aligned_copy
from ...threads import split_work

# direct_conv.h reads up to two float vectors past the end of each output row's input (one register
# tile of widths: 16 floats, or 8 doubles), and the weight gradient reads its rows of dy in whole
# vectors (direct_conv_dw_lanes: up to 16 floats), so the input up to a vector less one past the
# row: the padded copies leave that much room
ROW_SLACK = 16


def applies(geom):
    """Unit stride along the width, the same padding on both sides of every axis."""
    return not geom.transposed and geom.stride[-1] == 1 and geom.symmetric


def width_phases_apply(geom):
    """A width stride above 1 with no dilation along the width."""
    return (not geom.transposed and geom.stride[-1] > 1 and geom.dilation[-1] == 1 and geom.symmetric)


def _geometry(geom):
    """(padding, stride, dilation) of the forward as 3-D tuples."""
    _, stride, padding, dilation, _ = geom.windows
    return padding, stride, dilation


def _layout(groups):
    """Weights [groups, out_g, in_g, taps] as direct_conv.h reads them: per group, blocks of
    direct_conv_block() output channels (zero past out_g), each [in_g][taps][block]."""
    g, out_g, in_g, taps = groups.shape
    block = _kernels.direct_conv_block()
    blocks = (out_g + block - 1) // block
    padded = np.zeros((g, blocks * block, in_g, taps), groups.dtype)
    padded[:, :out_g] = groups
    return aligned_copy(padded.reshape(g, blocks, block, in_g, taps).transpose(0, 1, 3, 4, 2)).reshape(-1)


def _pack_direct(geom, weight, which):
    """The weight packed for direct_conv.h: 'forward', or 'input grad' (flipped taps, in/out
    channels swapped per group)."""
    out_g, in_g = geom.out_channels // geom.groups, geom.in_channels // geom.groups

    def build(buffer):
        groups = buffer.reshape(geom.groups, out_g, in_g, -1)
        if which == "input grad":
            groups = groups[..., ::-1].transpose(0, 2, 1, 3)  # [groups, in_g, out_g, taps]
        return _layout(groups)
    return weight.derived(("direct", which), build)


def _pack_width_phase(geom, weight, r):
    """The forward weight's taps of width phase r (widths r, r + s, ...) packed for direct_conv.h."""
    out_g, in_g, s = geom.out_channels // geom.groups, geom.in_channels // geom.groups, geom.stride[-1]

    def build(buffer):
        phase = buffer.reshape((geom.groups, out_g, in_g) + geom.kernel_size)[..., r::s]
        return _layout(phase.reshape(geom.groups, out_g, in_g, -1))
    return weight.derived(("width phase", r), build)


def _padded_shape(batch, padding):
    """The scratch a sample of `batch` is padded into for direct_conv.h: zeros around it, and
    ROW_SLACK more past each row for the last tile's vector loads."""
    c, d, h, w = as_volume(batch[0]).shape
    return c, d + 2 * padding[0], h + 2 * padding[1], w + 2 * padding[2] + ROW_SLACK


def run(geom, weight, ctx, which, src, dst, padding, stride, dilation, beta=0.0, bias=None, relu=False, pool_depth=0):
    """dst[n] = (beta·dst[n] +) direct_conv(src[n]) for every sample, split between threads; with
    beta 0, plus bias (None: none) and through a ReLU where relu is set, as the kernel stores;
    with pool_depth 1 or 2, dst is the max pool of kernel and stride pool_depth x 2 x 2 of that."""
    packed = _pack_direct(geom, weight, which)
    kernel = geom.windows[0]
    padded = _padded_shape(src, padding)

    def call(x, y, accumulate, threads):
        copies = [ctx.workspace(("padded", t), padded) for t in range(threads)]
        _kernels.direct_conv(x, packed, y, copies, geom.groups, *kernel, *stride[:2], *padding, *dilation, accumulate,
                             bias, relu, threads, pool_depth)
    columns.over_samples(ctx, src, dst, beta, call)


def forward(geom, weight, ctx, bias=None, relu=False, pool_depth=0):
    """ctx.output = the convolution (plus bias, through a ReLU where relu is set); with pool_depth,
    the max pool of kernel and stride pool_depth x 2 x 2 of it."""
    run(geom, weight, ctx, "forward", ctx.inputs[0], ctx.output, *_geometry(geom), 0.0, bias, relu, pool_depth)


def forward_width_phases(geom, weight, ctx):
    """A stride s > 1 along the width as s direct convolutions of unit width stride: the padded
    input's rows split by width phase (phase r holds widths r, r + s, ...: padded_copy), phase r
    convolved with the kernel's taps r, r + s, ... and added in. The multiply-adds are the
    convolution's own; no column matrix."""
    x, y = ctx.inputs[0], ctx.output
    kernel, stride, padding, dilation, _ = geom.windows
    s, (c, d, h, w) = stride[2], as_volume(x[0]).shape
    widths = [-(-(kernel[2] - r) // s) for r in range(s)]  # taps per phase (0 when kw < s)
    # a phase row holds its share of the padded input and every whole tile's reads (ROW_SLACK wide)
    row = max(-(-(w + padding[2]) // s), (-(-y.shape[-1] // ROW_SLACK)) * ROW_SLACK + max(widths) - 1)
    shape = (s * c, d + 2 * padding[0], h + 2 * padding[1], row)
    packs = [_pack_width_phase(geom, weight, r) if widths[r] else None for r in range(s)]

    def work(t, samples):
        xp = ctx.workspace(("padded phases", t), shape)
        for n in samples:
            _kernels.padded_copy(as_volume(x[n]), xp, *padding, s)
            for r in range(s):
                if widths[r]:
                    _kernels.direct_conv_padded(xp[r * c:(r + 1) * c], packs[r], as_volume(y[n]), geom.groups,
                                                kernel[0], kernel[1], widths[r], stride[0], stride[1], dilation[0],
                                                dilation[1], 1, accumulate=r > 0)
    split_work(x.shape[0], work, columns.threads(ctx))


def flipped_padding(geom):
    """The padding of the input gradient as a direct convolution of dy (all strides 1, and
    dilation·(k - 1) - padding not negative), or None when it is not one."""
    if not (applies(geom) and max(geom.stride) == 1):
        return None
    kernel, _, padding, dilation, _ = geom.windows
    flipped = tuple(d * (k - 1) - p for k, p, d in zip(kernel, padding, dilation))
    return flipped if min(flipped) >= 0 else None


def weight_grad_applies(geom, input_grad=True):
    """direct_conv_dw takes the weight gradient (its backward computes the input gradient by a
    stride-1 convolution of dy, so that must be one where it is wanted)."""
    return (applies(geom) and geom.kernel_size[-1] <= _kernels.direct_conv_dw_max_width()
            and (not input_grad or flipped_padding(geom) is not None))


def weight_grad_runs(geom, weight, ctx):
    # (not ctx.param_grad: asking for the target marks the gradient as written)
    return not weight.frozen and weight_grad_applies(geom, ctx.input_grad(0) is not None)


def backward(geom, weight, ctx, input_grad):
    """Weight gradient by direct_conv_dw, each thread adding its samples into its own part;
    input gradient by input_grad(geom, weight, ctx) (Winograd or the direct kernel on dy)."""
    be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
    kernel, stride, padding, dilation, _ = geom.windows
    count = columns.threads(ctx)
    parts = columns.weight_grad_parts(ctx, ctx.param_grad("weight"), count)
    input_grad(geom, weight, ctx)
    xp_shape = _padded_shape(x, padding)
    out = as_volume(dy[0]).shape
    lanes = _kernels.direct_conv_dw_lanes(dy.dtype == np.float32, out[3])
    dyp_shape = out[:3] + (-(-out[3] // lanes) * lanes,)
    partials = _kernels.direct_conv_dw_workspace(geom.in_channels // geom.groups, geom.out_channels // geom.groups,
                                                 *kernel, lanes)

    def work(t, samples):
        part, beta = parts[t]
        if beta == 0:
            be.fill(part, 0)
        xp = ctx.workspace(("padded", t), xp_shape)
        dyp = ctx.workspace(("padded dy", t), dyp_shape)
        scratch = ctx.workspace(("dw partials", t), (partials,))
        for n in samples:
            _kernels.direct_conv_dw(as_volume(x[n]), as_volume(dy[n]), part.reshape(-1), xp, dyp, scratch,
                                    geom.groups, *kernel, *stride[:2], *padding, *dilation)
    split_work(x.shape[0], work, count)
    columns.sum_weight_grad_parts(ctx, parts)
