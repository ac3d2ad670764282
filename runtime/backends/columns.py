"""Convolution by vol2col/col2vol and one GEMM per group: the algorithm every backend has, built
from its vol2col, col2vol and gemm. A backend with faster algorithms for some shapes (the CPU's
direct and depth-tap kernels, backends/cpu/conv_algorithms.py) overrides the Backend methods that
call these and falls back to them elsewhere.

Conv:       W [out, in/groups, *k]; per sample, col = vol2col(x) [in·K, P] and, per group,
            y_g = W_g col_g. Backward recomputes col: dW_g += dy_g col_gᵀ; dx = col2vol(W_gᵀ dy_g).
Transposed: W [in, out/groups, *k]; the mirror image: y = col2vol(W_gᵀ x_g); backward
            dcol = vol2col(dy), dx_g = W_g dcol_g, dW_g += x_g dcol_gᵀ.
In a bfloat16 run every one of these GEMMs takes both operands rounded to bfloat16 and sums in
float32 (Backend.gemm_in, as a Linear layer's products): the forward of inference and autocast
training, and autocast's backward.
A 2-D convolution is the 3-D one with depth 1. `geom` is its ConvGeometry
(lamina.backends.geometry), `weight` its weight Parameter; the bias is the layer's own step.

The samples of a batch are independent convolutions, each a chain of small GEMMs and copies;
`backend.sample_threads` says how many threads share them (lamina.threads.split_work), each with
its own column buffer and single-threaded kernels, instead of waking a team of threads for every
block. Weight gradients: the first thread adds into the parameter's gradient, the others into
their own buffers, summed at the end.
"""
import functools
import math

import numpy as np

from ..precision import product_precision
from ..threads import free_threads, get_num_threads, split_work

# vol2col works on blocks of window rows so that a block of the column matrix (about this many
# values) stays in cache between being written and being read by the GEMM: fewer, larger blocks
# pay until a block leaves the cache.
COL_BLOCK = 1 << 19


def as_volume(a):
    """A sample [C, *spatial] as [C, D, H, W]."""
    return a.reshape((a.shape[0],) + (1,) * (4 - a.ndim) + a.shape[1:])


def as_volumes(a):
    """Samples [N, C, *spatial] as [N, C, D, H, W]."""
    return a.reshape(a.shape[:2] + (1,) * (5 - a.ndim) + a.shape[2:])


def by_groups(a, groups):
    """A weight or its gradient as [groups, rows, cols]: conv [out_g, in_g·K], transposed
    [in_g, out_g·K]."""
    return a.reshape(groups, a.shape[0] // groups, -1)


def products(ctx):
    """The GEMM a convolution's products run with, gemm's arguments: the backend's gemm, or in a
    bfloat16 run its gemm_in in bfloat16 (lamina.precision.product_precision)."""
    precision = product_precision(ctx.precision)
    return ctx.be.gemm if precision == "float32" else functools.partial(ctx.be.gemm_in, precision)


def threads(ctx):
    return ctx.be.sample_threads(ctx.inputs[0].shape[0])


def block_ranges(col_rows, grid):
    """The window rows [r0, r1) of each block of a column matrix of col_rows rows over `grid`."""
    step = max(1, COL_BLOCK // (col_rows * grid[-1]))
    total = int(math.prod(grid[:-1]))
    return [(r0, min(total, r0 + step)) for r0 in range(0, total, step)]


class Blocks:
    """The column-matrix blocks of one convolution: window rows [r0, r1) of a grid, a buffer
    sized for the largest block, and each block's [rows, columns] view of it."""

    def __init__(self, ctx, col_rows, grid, key="col"):
        self.grid, self.rows = grid, col_rows
        self.ranges = block_ranges(col_rows, grid)
        largest = max((r1 - r0 for r0, r1 in self.ranges), default=0)
        self.buffer = ctx.workspace(key, (col_rows * largest * grid[-1],))

    def __iter__(self):
        return (self.block(i) for i in range(len(self.ranges)))

    def block(self, i):
        """Block i: its window rows (r0, r1), its columns' slice and its [rows, columns] view."""
        (r0, r1), width = self.ranges[i], self.grid[-1]
        cols = (r1 - r0) * width
        return (r0, r1), slice(r0 * width, r1 * width), self.buffer[:self.rows * cols].reshape(self.rows, cols)


class Replaced:
    """A layer's context as an algorithm sees it, with some of its attributes replaced: `output`
    (the full convolution that a fused max pool reads, instead of the node's own), `precision`
    (float32 products for a product too shallow to gain from bfloat16)."""

    def __init__(self, ctx, **replaced):
        self._ctx = ctx
        self.__dict__.update(replaced)

    def __getattr__(self, name):
        return getattr(self._ctx, name)


def over_samples(ctx, src, dst, beta, run, shares_samples=False):
    """run(x, y, accumulate, threads) for kernels that take a batch in one compiled call on a team
    of threads (the CPU's direct and Winograd), x and y volumes [n, C, D, H, W]; the members take
    runs of samples from a shared counter, so one that starts late or runs slower does fewer
    (halves fixed in advance left the caller waiting for a worker woken late): a team of at most
    one member per sample, unless the kernel shares a sample's work between members
    (shares_samples). With beta 0 the kernel overwrites dst, with 1 it adds to it; any other beta
    goes by way of a scratch output, then dst = beta·dst + scratch."""
    count = min(get_num_threads() if shares_samples else threads(ctx), free_threads())
    if beta in (0, 1):
        run(as_volumes(src), as_volumes(dst), beta == 1, count)
        return
    scratch = ctx.workspace("scaled output", dst.shape)
    run(as_volumes(src), as_volumes(scratch), False, count)
    ctx.be.axpby(1.0, scratch, beta, dst)


def weight_grad_parts(ctx, dw, count):
    """Per thread, (array, beta of its first write): the gradient itself for thread 0."""
    if dw is None:
        return [(None, 0.0)] * count
    return [(dw.array, dw.beta)] + [(ctx.workspace(("dweight", t), dw.array.shape), 0.0) for t in range(1, count)]


def sum_weight_grad_parts(ctx, parts):
    for part, _ in parts[1:]:
        ctx.be.axpby(1.0, part, 1.0, parts[0][0])


def _thread_start(ctx, t, col_rows, grid, parts, groups):
    """Thread t's column blocks, its weight-gradient part by groups and that part's first beta."""
    part, beta = parts[t]
    return Blocks(ctx, col_rows, grid, ("col", t)), (by_groups(part, groups) if part is not None else None), beta


def any_forward(geom, weight, ctx, bias=None, activation=None):
    """The forward of a plain or a transposed convolution, y = act(conv(x) + bias) (bias None:
    none; activation (kind, slope) or None): the outputs start from the bias (the products, or
    col2vol, add into it); the activation is a pass of its own over y."""
    if geom.transposed:
        transposed_forward(geom, weight, ctx, bias=bias)
    else:
        forward(geom, weight, ctx, bias=bias)
    ctx.be.activate_in_place(activation, ctx.output)


def finish(be, y, bias, activation):
    """y = act(y + bias) as passes of their own over y (bias None: none; activation (kind, slope)
    or None)."""
    if bias is not None:
        be.channel_bias(y, bias)
    be.activate_in_place(activation, y)


def forward(geom, weight, ctx, bias=None, product=None):
    """y = conv(x) + bias (None: none). Each sample's output is set to its bias first and the
    products add into it, which spares the product's own pass clearing y and a bias pass after.
    product(col, y_cols, team): a backend's own product of one column block [rows, columns] into
    its columns of a sample's output [out channels, columns] (a view of rows apart by the sample's
    positions), writing them whole (bias included), on up to `team` threads (more than one where
    a lone sample's lone block would leave the others idle); None: the GEMMs of each group."""
    be, x, y, gemm = ctx.be, ctx.inputs[0], ctx.output, products(ctx)
    geometry = geom.windows
    w = by_groups(weight.buffer, geom.groups)
    k_rows, out_g = w.shape[2], geom.out_channels // geom.groups
    col_rows = geom.in_channels * int(math.prod(geom.kernel_size))
    beta = 0.0 if bias is None else 1.0

    def start(n):
        if bias is not None and product is None:
            be.channel_bias(y[n:n + 1], bias, beta=0.0)

    if geom.pointwise:  # y_g = W_g x_g, one GEMM per sample and group on the input itself
        def pointwise(t, samples):
            for n in samples:
                start(n)
                xn, yn = x[n].reshape(geom.in_channels, -1), y[n].reshape(geom.out_channels, -1)
                for g in range(geom.groups):
                    gemm(w[g], xn[g * k_rows:(g + 1) * k_rows], yn[g * out_g:(g + 1) * out_g], beta=beta)
        split_work(x.shape[0], pointwise, threads(ctx))
        return

    # With fewer samples than the backend's host threads (a batch of one, at inference), the
    # threads share each sample's blocks of columns, every block a vol2col and products of its own
    # on one thread, instead of each block's product alone split between them (its vol2col on one
    # thread, a wake of the others for every block); the outputs start from their bias before.
    per_sample = len(block_ranges(col_rows, geometry[4]))
    sharing = min(be.sample_threads(x.shape[0] * per_sample), free_threads())
    by_blocks = sharing > threads(ctx)
    team = free_threads() if x.shape[0] * per_sample == 1 else 1
    if by_blocks:
        for n in range(x.shape[0]):
            start(n)

    def work(t, items):
        blocks = Blocks(ctx, col_rows, geometry[4], ("col", t))
        for i in items:
            n, part = divmod(i, per_sample) if by_blocks else (i, None)
            if not by_blocks:
                start(n)
            xn, yn = as_volume(x[n]), y[n].reshape(geom.out_channels, -1)
            for rows, cols, col in (blocks if part is None else [blocks.block(part)]):
                be.vol2col(xn, col, geometry, rows)
                if product is not None:
                    product(col, yn[:, cols], team)
                    continue
                for g in range(geom.groups):
                    gemm(w[g], col[g * k_rows:(g + 1) * k_rows], yn[g * out_g:(g + 1) * out_g, cols], beta=beta)
    if by_blocks:
        split_work(x.shape[0] * per_sample, work, sharing)
    else:
        split_work(x.shape[0], work, threads(ctx))


def backward(geom, weight, ctx, dx):
    """The weight gradient (when not frozen) and the input gradient into dx (a GradTarget, or
    None when it is not wanted or was computed already)."""
    be, x, dy, gemm = ctx.be, ctx.inputs[0], ctx.grad_output, products(ctx)
    geometry = geom.windows
    w = by_groups(weight.buffer, geom.groups)
    k_rows, out_g = w.shape[2], geom.out_channels // geom.groups
    col_rows = geom.in_channels * int(math.prod(geom.kernel_size))
    dw, count = ctx.param_grad("weight"), threads(ctx)
    if geom.pointwise:
        return _pointwise_backward(geom, weight, ctx, dx, dw)
    parts = weight_grad_parts(ctx, dw, count)

    def work(t, samples):
        blocks, dwg, beta = _thread_start(ctx, t, col_rows, geometry[4], parts, geom.groups)
        for n in samples:
            dyn, xn = dy[n].reshape(geom.out_channels, -1), as_volume(x[n])
            if dx is not None:
                dxn = as_volume(dx.array[n])
                if dx.beta == 0:
                    be.fill(dxn, 0)
            for rows, cols, col in blocks:
                if dwg is not None:  # dW_g += dy_g col_gᵀ
                    be.vol2col(xn, col, geometry, rows)
                    for g in range(geom.groups):
                        gemm(dyn[g * out_g:(g + 1) * out_g, cols], col[g * k_rows:(g + 1) * k_rows], dwg[g],
                             trans_b=True, beta=beta)
                    beta = 1.0
                if dx is not None:  # dx += col2vol(W_gᵀ dy_g)
                    for g in range(geom.groups):
                        gemm(w[g], dyn[g * out_g:(g + 1) * out_g, cols], col[g * k_rows:(g + 1) * k_rows],
                             trans_a=True)
                    be.col2vol(col, dxn, geometry, rows)
    split_work(x.shape[0], work, count)
    if dw is not None:
        sum_weight_grad_parts(ctx, parts)


def _pointwise_backward(geom, weight, ctx, dx, dw):
    """dW_g += dy_g x_gᵀ and dx_g = W_gᵀ dy_g (with their betas), sample by sample, on the
    input itself (pointwise: the input is the column matrix); the samples shared between threads,
    each summing its own part of dW."""
    x, dy, gemm = ctx.inputs[0], ctx.grad_output, products(ctx)
    w = by_groups(weight.buffer, geom.groups)
    in_g, out_g = w.shape[2], geom.out_channels // geom.groups
    count = threads(ctx)
    parts = weight_grad_parts(ctx, dw, count)

    def work(t, samples):
        part, beta = parts[t]
        dwg = by_groups(part, geom.groups) if part is not None else None
        for n in samples:
            xn, dyn = x[n].reshape(geom.in_channels, -1), dy[n].reshape(geom.out_channels, -1)
            for g in range(geom.groups):
                dyg = dyn[g * out_g:(g + 1) * out_g]
                if dwg is not None:
                    gemm(dyg, xn[g * in_g:(g + 1) * in_g], dwg[g], trans_b=True, beta=beta)
                if dx is not None:
                    gemm(w[g], dyg, dx.array[n].reshape(geom.in_channels, -1)[g * in_g:(g + 1) * in_g],
                         trans_a=True, beta=dx.beta)
            beta = 1.0
    split_work(x.shape[0], work, count)
    if dw is not None:
        sum_weight_grad_parts(ctx, parts)


def transposed_forward(geom, weight, ctx, place=None, bias=None):
    """place(col, y_n, geometry, rows), where given, writes a block's columns into the sample's
    output without its being zeroed first (every output written once: the CPU's depth-to-space
    when the kernel equals the stride); else col2vol adds them into an output zeroed, or set to
    its channel's bias where one is given."""
    be, x, y, gemm = ctx.be, ctx.inputs[0], ctx.output, products(ctx)
    geometry = geom.windows
    w = by_groups(weight.buffer, geom.groups)  # [groups, in_g, out_g·K]
    in_g, k_rows = w.shape[1], w.shape[2]
    col_rows = geom.out_channels * int(math.prod(geom.kernel_size))

    def work(t, samples):
        blocks = Blocks(ctx, col_rows, geometry[4], ("col", t))
        for n in samples:
            xn, yn = x[n].reshape(geom.in_channels, -1), as_volume(y[n])
            if place is None and bias is None:
                be.fill(yn, 0)
            elif place is None:
                be.channel_bias(y[n:n + 1], bias, beta=0.0)
            for rows, cols, col in blocks:
                for g in range(geom.groups):
                    gemm(w[g], xn[g * in_g:(g + 1) * in_g, cols], col[g * k_rows:(g + 1) * k_rows],
                         trans_a=True)
                (place or be.col2vol)(col, yn, geometry, rows)
    split_work(x.shape[0], work, threads(ctx))


def transposed_backward(geom, weight, ctx):
    be, x, dy, gemm = ctx.be, ctx.inputs[0], ctx.grad_output, products(ctx)
    geometry = geom.windows
    w = by_groups(weight.buffer, geom.groups)
    in_g, k_rows = w.shape[1], w.shape[2]
    col_rows = geom.out_channels * int(math.prod(geom.kernel_size))
    dw, dx, count = ctx.param_grad("weight"), ctx.input_grad(0), threads(ctx)
    parts = weight_grad_parts(ctx, dw, count)

    def work(t, samples):
        blocks, dwg, beta = _thread_start(ctx, t, col_rows, geometry[4], parts, geom.groups)
        for n in samples:
            xn, dyn = x[n].reshape(geom.in_channels, -1), as_volume(dy[n])
            dxn = dx.array[n].reshape(geom.in_channels, -1) if dx is not None else None
            for rows, cols, col in blocks:
                be.vol2col(dyn, col, geometry, rows)
                for g in range(geom.groups):
                    colg = col[g * k_rows:(g + 1) * k_rows]
                    if dxn is not None:  # dx_g = W_g dcol_g (blocks of columns are disjoint)
                        gemm(w[g], colg, dxn[g * in_g:(g + 1) * in_g, cols], beta=dx.beta)
                    if dwg is not None:  # dW_g += x_g dcol_gᵀ
                        gemm(xn[g * in_g:(g + 1) * in_g, cols], colg, dwg[g], trans_b=True, beta=beta)
                beta = 1.0
    split_work(x.shape[0], work, count)
    if dw is not None:
        sum_weight_grad_parts(ctx, parts)
