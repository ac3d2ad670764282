"""The CPU backend's convolution algorithms, and the rule that picks one per layer and shape.

- winograd: F(2x2x2, 3x3x3) and F(2x2, 3x3) for stride-1 kernels of 3 (pyx/winograd.h), the
  forward and the input gradient (dy with the kernel flipped and its in/out channels swapped);
  the transformed weights are cached per weight version.
- direct: with unit stride along the width and the same padding on both sides of every axis,
  the forward runs without a column matrix (pyx/direct_conv.h: 4 output channels x 2 vectors of
  widths per register tile, weights packed in reading order, cached per weight version), and
  with unit strides everywhere the input gradient too (the convolution of dy with the kernel
  flipped and its in/out channels swapped); the weight gradient by direct_conv_dw (kernel width
  up to direct_conv_dw_max_width()).
- depth taps: a 3-D convolution with depth stride 1 runs as kd accumulated GEMMs over a 2-D
  column matrix: with stride 1 the depth taps only shift which input depth slices an output
  slice reads, and each slice's columns are one contiguous block, so the column matrix needs
  only the kh·kw taps of every input slice. That is kd times less data to build than the full
  3-D column matrix (measured 2.4x faster forward on 16->32 channels, 32^3, kernel 3).
- direct, width phases: a width stride s > 1 as s unit-stride direct convolutions, one per
  width phase of the input (a candidate for 'measure'; the rule prefers columns, measured faster).
- depth to space: a transposed convolution whose kernel equals its stride writes each output
  once from its column matrix instead of adding it into a zeroed output.
- columns: vol2col + GEMM (lamina.backends.convolution), everything else.
"""
import logging
import math
import time

import numpy as np

from ... import _kernels
from .. import convolution as columns
from ..convolution import as_volume, as_volumes
from ...threads import SettingError, get_num_threads, split_work

# direct_conv.h reads up to two float vectors past the end of each output row's input, and the
# weight gradient reads dy in whole vectors: the padded copies leave that much room
ROW_SLACK = 16
DY_ROW_MULTIPLE = 8


_log = logging.getLogger("lamina.conv")

ALGORITHMS = ("winograd", "direct", "direct, width phases", "depth taps", "depth to space", "columns")
_setting = {"mode": "rule"}
_measured = {}  # (layer geometry, input shape, dtype, threads) -> the fastest forward measured


def set_conv_algorithm(mode):
    """How the CPU picks a convolution's forward algorithm, process-wide: 'rule' (the default:
    by the shape, as forward_algorithm says), 'measure' (time every algorithm that applies once
    per layer geometry, input shape and thread count, then keep the fastest, like cuDNN's
    benchmark mode; logged at DEBUG on 'lamina.conv'), or one of ALGORITHMS (that one wherever
    it applies, the rule elsewhere)."""
    if mode not in ("rule", "measure") + ALGORITHMS:
        raise SettingError(f"set_conv_algorithm: expected 'rule', 'measure' or one of {', '.join(ALGORITHMS)}, "
                           f"found {mode!r}")
    _setting["mode"] = mode
    _measured.clear()


def get_conv_algorithm():
    return _setting["mode"]


def candidates(conv):
    """The forward algorithms that apply to a convolution."""
    if conv.transposed:
        return (["depth to space"] if _no_overlap(conv) else []) + ["columns"]
    found = [name for name, applies in (("winograd", _winograd), ("direct", _direct),
                                        ("direct, width phases", _width_phases), ("depth taps", _depth_taps))
             if applies(conv)]
    return found + ["columns"]


# The rule, from measurements on the bench's shapes (2 threads, ms, one run each; the machine's
# speed drifts, the ratios hold): Winograd wherever it applies with at least WINOGRAD_MIN_CHANNELS
# channels in and out (D forward: Winograd 72.9, direct 120.3, depth taps 106.3, columns 125.9;
# the 2-D CNN's 32 -> 64 at 14x14: 6.2, 11.0, -, 9.1; but 1 -> 32 at 28x28: 7.6, 4.3, -, 6.5, a
# single input channel padded to a vector of eight); then the direct kernel, depth taps, columns.
WINOGRAD_MIN_CHANNELS = 8
_RULE = ("winograd", "direct", "depth taps", "depth to space", "columns")


def _pick(conv, found):
    """Of the algorithms that apply, the one forced, else the rule's first."""
    if _setting["mode"] in found:
        return _setting["mode"]
    few = min(conv.in_channels, conv.out_channels) < WINOGRAD_MIN_CHANNELS
    return next((name for name in _RULE if name in found and not (few and name == "winograd")), None)


def forward_algorithm(conv):
    """The algorithm the rule (or a forced setting) runs a convolution's forward with."""
    return _pick(conv, candidates(conv))


def _input_grad_algorithm(conv):
    """'winograd' or 'direct' where the input gradient runs as a stride-1 convolution of dy with
    the flipped kernel, else None (the backward's column or depth-tap path computes it)."""
    return _pick(conv, [name for name, applies in (("winograd", _winograd(conv)),
                                                   ("direct", _flipped_padding(conv) is not None)) if applies])


def algorithms(conv):
    """{'forward', 'input grad', 'weight grad'}: the algorithm of each (the input gradient
    assumed wanted); 'measured' where the forward is timed per shape."""
    taps = "depth taps" if _depth_taps(conv) else "columns"
    return {"forward": "measured" if _setting["mode"] == "measure" else forward_algorithm(conv),
            "input grad": _input_grad_algorithm(conv) or taps,
            "weight grad": "direct" if _direct_weight_grad_applies(conv) else taps}


def forward(conv, ctx):
    """A convolution's forward, plain or transposed."""
    _FORWARD[_choose_forward(conv, ctx)](conv, ctx)


def _choose_forward(conv, ctx):
    if _setting["mode"] != "measure":
        return forward_algorithm(conv)
    x = ctx.inputs[0]
    key = (type(conv).__name__, repr(conv.config()), x.shape, x.dtype.str, get_num_threads())
    choice = _measured.get(key)
    if choice is None:
        times = {}
        for name in candidates(conv):
            best = math.inf
            for _ in range(2):  # the first call also sizes the workspaces
                start = time.perf_counter()
                _FORWARD[name](conv, ctx)
                best = min(best, time.perf_counter() - start)
            times[name] = best
        choice = _measured[key] = min(times, key=times.get)
        _log.debug("%s %s on %s: %s (%s)", type(conv).__name__, conv.config(), x.shape, choice,
                   ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in times.items()))
    return choice


def backward(conv, ctx):
    """A plain convolution's weight and input gradients."""
    if _direct_weight_grad(conv, ctx):
        return _backward_direct(conv, ctx)
    if _depth_taps(conv):
        return _backward_depth_taps(conv, ctx)
    columns.backward(conv, ctx, _input_grad(conv, ctx))


def _direct(conv):
    return not conv.transposed and conv.stride[-1] == 1 and conv.symmetric


def _forward_direct(conv, ctx):
    _direct_run(conv, ctx, "forward", ctx.inputs[0], ctx.output, *_direct_geometry(conv, ctx.output))


# ---------------------------------------------------------------- Winograd F(2, 3)
# Tiles per block of winograd.h: its transformed input and products, XI · block · (Cp + COp)
# values, stay in cache between the transforms and the GEMMs.
WINOGRAD_BLOCK_VALUES = 1 << 16
# G of F(2, 3): the kernel's transform along each axis
_WINOGRAD_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def _winograd(conv):
    """A kernel of 3 along height and width (and depth, or depth 1 without depth padding), stride
    and dilation 1, one group, the same padding on both sides, at most 2 (the input gradient's
    is 2 - padding)."""
    k = conv.kernel_size
    return (not conv.transposed and conv.groups == 1 and max(conv.stride + conv.dilation) == 1 and conv.symmetric
            and k[-2:] == (3, 3) and (conv.nd == 2 or k[0] == 3 or (k[0] == 1 and conv.padding[0] == 0))
            and max(conv.padding) <= 2)


def _winograd_depth3(conv):
    return conv.nd == 3 and conv.kernel_size[0] == 3


def _winograd_weights(conv, which):
    """U_ξ = G g Gᵀ along each axis, [XI][Cin][Cout] zero-padded to whole vectors of channels and
    panel-packed per ξ: 'forward', or 'input grad' (flipped taps, in/out channels swapped)."""
    depth3 = _winograd_depth3(conv)

    def build(buffer):
        w = buffer.astype(np.float64).reshape((conv.out_channels, conv.in_channels) + conv.kernel_size[-3:])
        if which == "input grad":
            w = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4) if w.ndim == 5 else \
                w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
        if w.ndim == 5 and not depth3:
            w = w[:, :, 0]
        g = _WINOGRAD_G
        u = (np.einsum("ai,bj,ck,oxijk->abcxo", g, g, g, w) if depth3 else
             np.einsum("bj,ck,oxjk->bcxo", g, g, w))
        cin, cout = w.shape[1], w.shape[0]
        u = u.reshape(-1, cin, cout)
        lanes = _kernels.winograd_lanes(buffer.dtype == np.float32)
        cp, nr = -(-cin // lanes) * lanes, 2 * lanes
        panels = -(-(-(-cout // lanes) * lanes) // nr)
        padded = np.zeros((u.shape[0], cp, panels * nr))
        padded[:, :cin, :cout] = u
        packed = padded.reshape(u.shape[0], cp, panels, nr).transpose(0, 2, 1, 3)
        return np.ascontiguousarray(packed, dtype=buffer.dtype).reshape(-1)
    return conv.weight.derived(("winograd", which), build)


def _winograd_run(conv, ctx, which, src, dst, padding, beta=0.0):
    """dst[n] = (beta·dst[n] +) the Winograd convolution of src[n], split between threads."""
    packed, depth3 = _winograd_weights(conv, which), _winograd_depth3(conv)
    c, d, h, w = as_volume(src[0]).shape
    cout = dst.shape[1]
    lanes = _kernels.winograd_lanes(src.dtype == np.float32)
    xi = 64 if depth3 else 16
    block = max(6, WINOGRAD_BLOCK_VALUES // (xi * (-(-c // lanes) + -(-cout // lanes)) * lanes) // 6 * 6)
    pd = padding[0] if depth3 else 0
    sizes = _kernels.winograd_workspace(c, cout, d, h, w, pd, padding[1], padding[2], depth3, block,
                                        src.dtype == np.float32)

    def run(t, x, y, accumulate):
        xcl, v, m = (ctx.workspace(("winograd " + key, t), (size,)) for key, size in zip(("xcl", "V", "M"), sizes))
        _kernels.winograd_conv(x, packed, y, xcl, v, m, pd, padding[1], padding[2], depth3, block, accumulate)
    _over_samples(ctx, src, dst, beta, run)


def _forward_winograd(conv, ctx):
    _winograd_run(conv, ctx, "forward", ctx.inputs[0], ctx.output, conv.geometry((1,) * conv.nd)[2])


# ---------------------------------------------------------------- transposed, kernel = stride
def _no_overlap(conv):
    """A transposed convolution whose windows do not overlap: kernel = stride on every axis, no
    padding, dilation or output padding (a U-Net's up-convolution, kernel 2, stride 2)."""
    return (conv.transposed and conv.kernel_size == conv.stride and max(conv.padding + conv.padding_end) == 0
            and max(conv.dilation) == 1 and max(conv.output_padding) == 0)


def _forward_depth_to_space(conv, ctx):
    """One GEMM per block of input positions into the column matrix, whose rows then land in the
    output once each (depth_to_space), instead of being added into a zeroed output."""
    columns.transposed_forward(conv, ctx, place=lambda col, y, geometry, rows: _kernels.depth_to_space(
        col, y, *geometry[1], *rows))


def _width_phases(conv):
    return (not conv.transposed and conv.stride[-1] > 1 and conv.dilation[-1] == 1 and conv.symmetric)


def _depth_taps(conv):
    return (conv.nd == 3 and not conv.transposed and conv.stride[0] == 1 and conv.kernel_size[0] > 1
            and conv.symmetric)


# ---------------------------------------------------------------- direct
def _direct_geometry(conv, out):
    """(padding, stride, dilation) of the forward as 3-D tuples."""
    _, stride, padding, dilation, _ = conv.geometry(out.shape[2:])
    return padding, stride, dilation


def _direct_layout(groups):
    """Weights [groups, out_g, in_g, taps] as direct_conv.h reads them: per group, blocks of
    direct_conv_block() output channels (zero past out_g), each [in_g][taps][block]."""
    g, out_g, in_g, taps = groups.shape
    block = _kernels.direct_conv_block()
    blocks = (out_g + block - 1) // block
    padded = np.zeros((g, blocks * block, in_g, taps), groups.dtype)
    padded[:, :out_g] = groups
    return np.ascontiguousarray(padded.reshape(g, blocks, block, in_g, taps).transpose(0, 1, 3, 4, 2)).reshape(-1)


def _pack_direct(conv, which):
    """The weight packed for direct_conv.h: 'forward', or 'input grad' (flipped taps, in/out
    channels swapped per group)."""
    out_g, in_g = conv.out_channels // conv.groups, conv.in_channels // conv.groups

    def build(buffer):
        groups = buffer.reshape(conv.groups, out_g, in_g, -1)
        if which == "input grad":
            groups = groups[..., ::-1].transpose(0, 2, 1, 3)  # [groups, in_g, out_g, taps]
        return _direct_layout(groups)
    return conv.weight.derived(("direct", which), build)


def _pack_width_phase(conv, r):
    """The forward weight's taps of width phase r (widths r, r + s, ...) packed for direct_conv.h."""
    out_g, in_g, s = conv.out_channels // conv.groups, conv.in_channels // conv.groups, conv.stride[-1]

    def build(buffer):
        phase = buffer.reshape((conv.groups, out_g, in_g) + conv.kernel_size)[..., r::s]
        return _direct_layout(phase.reshape(conv.groups, out_g, in_g, -1))
    return conv.weight.derived(("width phase", r), build)


def _padded_shape(batch, padding):
    """The scratch a sample of `batch` is padded into for direct_conv.h: zeros around it, and
    ROW_SLACK more past each row for the last tile's vector loads."""
    c, d, h, w = as_volume(batch[0]).shape
    return c, d + 2 * padding[0], h + 2 * padding[1], w + 2 * padding[2] + ROW_SLACK


def _direct_run(conv, ctx, which, src, dst, padding, stride, dilation, beta=0.0):
    """dst[n] = (beta·dst[n] +) direct_conv(src[n]) for every sample, split between threads."""
    packed = _pack_direct(conv, which)
    kernel = conv.geometry(dst.shape[2:])[0]
    padded = _padded_shape(src, padding)

    def run(t, x, y, accumulate):
        _kernels.direct_conv(x, packed, y, ctx.workspace(("padded", t), padded), conv.groups, *kernel, *stride[:2],
                             *padding, *dilation, accumulate)
    _over_samples(ctx, src, dst, beta, run)


def _over_samples(ctx, src, dst, beta, run):
    """run(t, x, y, accumulate) on thread t's run of samples in one compiled call, x and y their
    volumes [n, C, D, H, W]: beta 0 overwrites dst, 1 adds to it, any other beta goes by way of a
    scratch output, a sample at a time."""
    def work(t, samples):
        s0, s1 = samples[0], samples[-1] + 1
        if beta in (0, 1):
            return run(t, as_volumes(src[s0:s1]), as_volumes(dst[s0:s1]), beta == 1)
        scratch = ctx.workspace(("scaled output", t), (1,) + dst.shape[1:])
        for n in samples:
            run(t, as_volumes(src[n:n + 1]), as_volumes(scratch), False)
            ctx.be.axpby(1.0, scratch[0], beta, dst[n])
    split_work(src.shape[0], work, columns.threads(ctx))


def _forward_width_phases(conv, ctx):
    """A stride s > 1 along the width as s direct convolutions of unit width stride: the padded
    input's rows split by width phase (phase r holds widths r, r + s, ...: padded_copy), phase r
    convolved with the kernel's taps r, r + s, ... and added in. The multiply-adds are the
    convolution's own; no column matrix."""
    x, y = ctx.inputs[0], ctx.output
    kernel, stride, padding, dilation, _ = conv.geometry(y.shape[2:])
    s, (c, d, h, w) = stride[2], as_volume(x[0]).shape
    widths = [-(-(kernel[2] - r) // s) for r in range(s)]  # taps per phase (0 when kw < s)
    row = max(-(-(w + padding[2]) // s), (-(-y.shape[-1] // ROW_SLACK)) * ROW_SLACK + max(widths) - 1)
    shape = (s * c, d + 2 * padding[0], h + 2 * padding[1], row)
    packs = [_pack_width_phase(conv, r) if widths[r] else None for r in range(s)]

    def work(t, samples):
        xp = ctx.workspace(("padded phases", t), shape)
        for n in samples:
            _kernels.padded_copy(as_volume(x[n]), xp, *padding, s)
            for r in range(s):
                if widths[r]:
                    _kernels.direct_conv_padded(xp[r * c:(r + 1) * c], packs[r], as_volume(y[n]), conv.groups,
                                                kernel[0], kernel[1], widths[r], stride[0], stride[1], dilation[0],
                                                dilation[1], 1, accumulate=r > 0)
    split_work(x.shape[0], work, columns.threads(ctx))


def _flipped_padding(conv):
    """The padding of the input gradient as a direct convolution of dy (all strides 1, and
    dilation·(k - 1) - padding not negative), or None when it is not one."""
    if not (_direct(conv) and max(conv.stride) == 1):
        return None
    kernel, _, padding, dilation, _ = conv.geometry((1,) * conv.nd)
    flipped = tuple(d * (k - 1) - p for k, p, d in zip(kernel, padding, dilation))
    return flipped if min(flipped) >= 0 else None


def _input_grad(conv, ctx):
    """The input-gradient target the column paths should fill: None when the gradient is not
    wanted or was computed here (Winograd or the direct kernel on dy, flipped kernel)."""
    dx, algorithm = ctx.input_grad(0), _input_grad_algorithm(conv)
    if dx is None or algorithm is None:
        return dx
    flipped = _flipped_padding(conv)
    if algorithm == "winograd":
        _winograd_run(conv, ctx, "input grad", ctx.grad_output, dx.array, flipped, dx.beta)
    else:
        dilation = conv.geometry(ctx.grad_output.shape[2:])[3]
        _direct_run(conv, ctx, "input grad", ctx.grad_output, dx.array, flipped, (1, 1, 1), dilation, dx.beta)
    return None


def _direct_weight_grad_applies(conv, input_grad=True):
    """direct_conv_dw takes the weight gradient (its backward computes the input gradient by a
    stride-1 convolution of dy, so that must be one where it is wanted)."""
    return (_direct(conv) and conv.kernel_size[-1] <= _kernels.direct_conv_dw_max_width()
            and (not input_grad or _flipped_padding(conv) is not None))


def _direct_weight_grad(conv, ctx):
    # (not ctx.param_grad: asking for the target marks the gradient as written)
    return not conv.weight.frozen and _direct_weight_grad_applies(conv, ctx.input_grad(0) is not None)


def _backward_direct(conv, ctx):
    """Weight gradient by direct_conv_dw, each thread adding its samples into its own part;
    input gradient by the direct kernel too."""
    be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
    kernel, stride, padding, dilation, _ = conv.geometry(dy.shape[2:])
    count = columns.threads(ctx)
    parts = columns.weight_grad_parts(ctx, ctx.param_grad("weight"), count)
    _input_grad(conv, ctx)
    xp_shape = _padded_shape(x, padding)
    out = as_volume(dy[0]).shape
    dyp_shape = out[:3] + (-(-out[3] // DY_ROW_MULTIPLE) * DY_ROW_MULTIPLE,)
    partials = _kernels.direct_conv_dw_workspace(conv.in_channels // conv.groups, conv.out_channels // conv.groups,
                                                 *kernel, dy.dtype == np.float32)

    def work(t, samples):
        part, beta = parts[t]
        if beta == 0:
            be.fill(part, 0)
        xp = ctx.workspace(("padded", t), xp_shape)
        dyp = ctx.workspace(("padded dy", t), dyp_shape)
        scratch = ctx.workspace(("dw partials", t), (partials,))
        for n in samples:
            _kernels.direct_conv_dw(as_volume(x[n]), as_volume(dy[n]), part.reshape(-1), xp, dyp, scratch,
                                    conv.groups, *kernel, *stride[:2], *padding, *dilation)
    split_work(x.shape[0], work, count)
    columns.sum_weight_grad_parts(ctx, parts)


# ---------------------------------------------------------------- depth taps (stride_d = 1)
def _slabs(conv, ctx, key="col2d"):
    """Blocks of output depth slices [o0, o1), each with the input slices [i_lo, i_hi) it
    reads (its own plus a halo of (kd - 1)·dd), a column-matrix view for those input slices,
    and the taps (a, od0, od1, first column slice) that land in the block. Blocks keep the
    column matrix in cache; the halo is rebuilt per block, so blocks span several slices."""
    depth, out_depth = ctx.inputs[0].shape[2], ctx.output.shape[2]
    kd, pd, dd = conv.kernel_size[0], conv.padding[0], conv.dilation[0]
    col_rows = conv.in_channels * conv.kernel_size[1] * conv.kernel_size[2]
    plane = int(np.prod(ctx.output.shape[3:]))
    halo = (kd - 1) * dd
    slab = max(columns.COL_BLOCK // (col_rows * plane), 4 * halo, 1)
    buffer = ctx.workspace(key, (col_rows * min(slab + halo, depth) * plane,))
    for o0 in range(0, out_depth, slab):
        o1 = min(out_depth, o0 + slab)
        i_lo, i_hi = max(0, o0 - pd), min(depth, o1 - 1 - pd + halo + 1)
        if i_hi <= i_lo:
            continue
        col = buffer[:col_rows * (i_hi - i_lo) * plane].reshape(col_rows, (i_hi - i_lo) * plane)
        taps = []
        for a in range(kd):
            od0, od1 = max(o0, pd - a * dd), min(o1, depth + pd - a * dd)
            if od1 > od0:
                first = od0 - pd + a * dd - i_lo
                taps.append((a, slice(od0 * plane, od1 * plane), slice(first * plane, (first + od1 - od0) * plane)))
        yield (i_lo, i_hi), col, taps


def _tap_weights(conv):
    """The weight as [kd, groups, out_g, in_g·kh·kw] (a layout copy, rebuilt when it changes)."""
    kd, k2 = conv.kernel_size[0], conv.kernel_size[1] * conv.kernel_size[2]
    out_g, in_g = conv.out_channels // conv.groups, conv.in_channels // conv.groups

    def build(buffer):
        taps = buffer.reshape(conv.groups, out_g, in_g, kd, k2).transpose(3, 0, 1, 2, 4)
        return np.ascontiguousarray(taps).reshape(kd, conv.groups, out_g, in_g * k2)
    return conv.weight.derived("depth taps", build)


def _plane_geometry(conv, ctx):
    """vol2col over input depth slices with the kh·kw taps only."""
    depth, grid = ctx.inputs[0].shape[2], ctx.output.shape[3:]
    return ((1,) + conv.kernel_size[1:], (1,) + conv.stride[1:], (0,) + conv.padding[1:],
            (1,) + conv.dilation[1:], (depth,) + tuple(grid))


def _forward_depth_taps(conv, ctx):
    be, x, y = ctx.be, ctx.inputs[0], ctx.output
    geometry, out_h = _plane_geometry(conv, ctx), y.shape[3]
    wt = _tap_weights(conv)
    rows, out_g = wt.shape[3], conv.out_channels // conv.groups

    def work(t, samples):
        for n in samples:
            yn = y[n].reshape(conv.out_channels, -1)
            be.fill(yn, 0)
            for (i_lo, i_hi), col, taps in _slabs(conv, ctx, ("col2d", t)):
                be.vol2col(x[n], col, geometry, (i_lo * out_h, i_hi * out_h))
                for a, out_cols, col_cols in taps:
                    for g in range(conv.groups):
                        be.gemm(wt[a, g], col[g * rows:(g + 1) * rows, col_cols],
                                yn[g * out_g:(g + 1) * out_g, out_cols], beta=1.0)
    split_work(x.shape[0], work, columns.threads(ctx))


def _backward_depth_taps(conv, ctx):
    be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
    geometry, out_h = _plane_geometry(conv, ctx), dy.shape[3]
    wt = _tap_weights(conv)
    rows, out_g = wt.shape[3], conv.out_channels // conv.groups
    dw, dx = ctx.param_grad("weight"), _input_grad(conv, ctx)
    count = columns.threads(ctx)
    # tap-major weight gradients, one per thread, all starting from zero
    dwts = [ctx.workspace(("dweight_taps", t), wt.shape) for t in range(count)] if dw is not None else None

    def work(t, samples):
        dwt = dwts[t] if dwts is not None else None
        if dwt is not None:
            be.fill(dwt, 0)
        for n in samples:
            dyn = dy[n].reshape(conv.out_channels, -1)
            if dx is not None and dx.beta == 0:
                be.fill(dx.array[n], 0)
            for (i_lo, i_hi), col, taps in _slabs(conv, ctx, ("col2d", t)):
                window = (i_lo * out_h, i_hi * out_h)
                if dwt is not None:  # dW_a,g += dy_g[output slices] col_g[their input slices]ᵀ
                    be.vol2col(x[n], col, geometry, window)
                    for a, out_cols, col_cols in taps:
                        for g in range(conv.groups):
                            be.gemm(dyn[g * out_g:(g + 1) * out_g, out_cols],
                                    col[g * rows:(g + 1) * rows, col_cols], dwt[a, g], trans_b=True, beta=1.0)
                if dx is not None:  # dcol[input slices] += W_a,gᵀ dy_g[output slices]; dx += col2vol(dcol)
                    be.fill(col, 0)
                    for a, out_cols, col_cols in taps:
                        for g in range(conv.groups):
                            be.gemm(wt[a, g], dyn[g * out_g:(g + 1) * out_g, out_cols],
                                    col[g * rows:(g + 1) * rows, col_cols], trans_a=True, beta=1.0)
                    be.col2vol(col, dx.array[n], geometry, window)
    split_work(x.shape[0], work, count)
    if dwts is not None:  # back to PyTorch's layout [out, in_g, kd, kh, kw] (a layout copy)
        dwt = dwts[0]
        for other in dwts[1:]:
            be.axpby(1.0, other, 1.0, dwt)
        kd, k2 = conv.kernel_size[0], conv.kernel_size[1] * conv.kernel_size[2]
        in_g = conv.in_channels // conv.groups
        back = dwt.reshape(kd, conv.groups, out_g, in_g, k2).transpose(1, 2, 3, 0, 4).reshape(dw.array.shape)
        if dw.beta == 0:
            dw.array[...] = back
        else:
            dw.array[...] += back


_FORWARD = {"winograd": _forward_winograd, "direct": _forward_direct, "direct, width phases": _forward_width_phases,
            "depth taps": _forward_depth_taps, "depth to space": _forward_depth_to_space,
            "columns": lambda conv, ctx: (columns.transposed_forward if conv.transposed else columns.forward)(conv, ctx)}
