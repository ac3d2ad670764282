"""The CPU's depth taps: a 3-D convolution with depth stride 1 runs as kd accumulated GEMMs over
a 2-D column matrix. With stride 1 the depth taps only shift which input depth slices an output
slice reads, and each slice's columns are one contiguous block, so the column matrix needs only
the kh·kw taps of every input slice: kd times less data to build than the full 3-D column
matrix."""
import math

import numpy as np

from .. import columns
from ...threads import split_work


def applies(geom):
    """A 3-D convolution with depth stride 1 and a kernel deeper than 1."""
    return (geom.nd == 3 and not geom.transposed and geom.stride[0] == 1 and geom.kernel_size[0] > 1
            and geom.symmetric)


def _slabs(geom, ctx, key="col2d"):
    """Blocks of output depth slices [o0, o1), each with the input slices [i_lo, i_hi) it
    reads (its own plus a halo of (kd - 1)·dd), a column-matrix view for those input slices,
    and the taps (a, od0, od1, first column slice) that land in the block. Blocks keep the
    column matrix in cache; the halo is rebuilt per block, so blocks span several slices."""
    depth, out_depth = ctx.inputs[0].shape[2], ctx.output.shape[2]
    kd, pd, dd = geom.kernel_size[0], geom.padding[0], geom.dilation[0]
    col_rows = geom.in_channels * geom.kernel_size[1] * geom.kernel_size[2]
    plane = int(math.prod(ctx.output.shape[3:]))
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


def _tap_weights(geom, weight):
    """The weight as [kd, groups, out_g, in_g·kh·kw] (a layout copy, rebuilt when it changes)."""
    kd, k2 = geom.kernel_size[0], geom.kernel_size[1] * geom.kernel_size[2]
    out_g, in_g = geom.out_channels // geom.groups, geom.in_channels // geom.groups

    def build(buffer):
        taps = buffer.reshape(geom.groups, out_g, in_g, kd, k2).transpose(3, 0, 1, 2, 4)
        return np.ascontiguousarray(taps).reshape(kd, geom.groups, out_g, in_g * k2)
    return weight.derived("depth taps", build)


def _plane_geometry(geom):
    """vol2col over input depth slices with the kh·kw taps only."""
    return ((1,) + geom.kernel_size[1:], (1,) + geom.stride[1:], (0,) + geom.padding[1:],
            (1,) + geom.dilation[1:], (geom.in_size[0],) + geom.out_size[1:])


def forward(geom, weight, ctx):
    be, x, y, gemm = ctx.be, ctx.inputs[0], ctx.output, columns.products(ctx)
    geometry, out_h = _plane_geometry(geom), y.shape[3]
    wt = _tap_weights(geom, weight)
    rows, out_g = wt.shape[3], geom.out_channels // geom.groups

    def work(t, samples):
        for n in samples:
            yn = y[n].reshape(geom.out_channels, -1)
            be.fill(yn, 0)
            for (i_lo, i_hi), col, taps in _slabs(geom, ctx, ("col2d", t)):
                be.vol2col(x[n], col, geometry, (i_lo * out_h, i_hi * out_h))
                for a, out_cols, col_cols in taps:
                    for g in range(geom.groups):
                        gemm(wt[a, g], col[g * rows:(g + 1) * rows, col_cols],
                             yn[g * out_g:(g + 1) * out_g, out_cols], beta=1.0)
    split_work(x.shape[0], work, columns.threads(ctx))


def backward(geom, weight, ctx, input_grad):
    be, x, dy, gemm = ctx.be, ctx.inputs[0], ctx.grad_output, columns.products(ctx)
    geometry, out_h = _plane_geometry(geom), dy.shape[3]
    wt = _tap_weights(geom, weight)
    rows, out_g = wt.shape[3], geom.out_channels // geom.groups
    dw, dx = ctx.param_grad("weight"), input_grad(geom, weight, ctx)
    count = columns.threads(ctx)
    # tap-major weight gradients, one per thread, all starting from zero
    dwts = [ctx.workspace(("dweight_taps", t), wt.shape) for t in range(count)] if dw is not None else None

    def work(t, samples):
        dwt = dwts[t] if dwts is not None else None
        if dwt is not None:
            be.fill(dwt, 0)
        for n in samples:
            dyn = dy[n].reshape(geom.out_channels, -1)
            if dx is not None and dx.beta == 0:
                be.fill(dx.array[n], 0)
            for (i_lo, i_hi), col, taps in _slabs(geom, ctx, ("col2d", t)):
                window = (i_lo * out_h, i_hi * out_h)
                if dwt is not None:  # dW_a,g += dy_g[output slices] col_g[their input slices]ᵀ
                    be.vol2col(x[n], col, geometry, window)
                    for a, out_cols, col_cols in taps:
                        for g in range(geom.groups):
                            gemm(dyn[g * out_g:(g + 1) * out_g, out_cols],
                                 col[g * rows:(g + 1) * rows, col_cols], dwt[a, g], trans_b=True, beta=1.0)
                if dx is not None:  # dcol[input slices] += W_a,gᵀ dy_g[output slices]; dx += col2vol(dcol)
                    be.fill(col, 0)
                    for a, out_cols, col_cols in taps:
                        for g in range(geom.groups):
                            gemm(wt[a, g], dyn[g * out_g:(g + 1) * out_g, out_cols],
                                 col[g * rows:(g + 1) * rows, col_cols], trans_a=True, beta=1.0)
                    be.col2vol(col, dx.array[n], geometry, window)
    split_work(x.shape[0], work, count)
    if dwts is not None:  # back to PyTorch's layout [out, in_g, kd, kh, kw] (a layout copy)
        dwt = dwts[0]
        for other in dwts[1:]:
            be.axpby(1.0, other, 1.0, dwt)
        kd, k2 = geom.kernel_size[0], geom.kernel_size[1] * geom.kernel_size[2]
        in_g = geom.in_channels // geom.groups
        back = dwt.reshape(kd, geom.groups, out_g, in_g, k2).transpose(1, 2, 3, 0, 4).reshape(dw.array.shape)
        if dw.beta == 0:
            dw.array[...] = back
        else:
            dw.array[...] += back
