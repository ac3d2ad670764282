"""Convolution and transposed convolution over 3-D volumes (NCDHW) and 2-D images (NCHW), by
vol2col/col2vol and one GEMM per group, with PyTorch's arguments and weight layouts.

Conv:       W [out, in/groups, *k]; per sample, col = vol2col(x) [in·K, P] and, per group,
            y_g = W_g col_g. Backward recomputes col: dW_g += dy_g col_gᵀ; dx = col2vol(W_gᵀ dy_g).
Transposed: W [in, out/groups, *k]; the mirror image: y = col2vol(W_gᵀ x_g); backward
            dcol = vol2col(dy), dx_g = W_g dcol_g, dW_g += x_g dcol_gᵀ.
A 2-D layer is the 3-D code with depth 1 (kernel depth 1, stride 1, padding 0).
Output sizes follow PyTorch's formulas; an empty output or channels that groups do not divide
are errors naming the layer.
"""
import math

import numpy as np

from .. import _kernels
from ..graph import Spec
from ..random import generator
from ..threads import get_num_threads, split_work
from .base import Layer, int_tuple, padding_pairs, register, require_volume, uniform


class _ConvNd(Layer):
    nd = 3
    transposed = False
    opencl = True

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, bias=True, output_padding=0, name=None):
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
        k = int(np.prod(self.kernel_size))
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
        """Whether every axis is padded alike on both sides (the direct and depth-tap kernels
        take one padding per axis; vol2col and col2vol read the grid they are given)."""
        return self.padding == self.padding_end

    def _out_sizes(self, sizes):
        if self.transposed:
            return tuple((n - 1) * s - p - q + d * (k - 1) + op + 1 for n, k, s, p, q, d, op in
                         zip(sizes, self.kernel_size, self.stride, self.padding, self.padding_end, self.dilation,
                             self.output_padding))
        return tuple((n + p + q - d * (k - 1) - 1) // s + 1 for n, k, s, p, q, d in
                     zip(sizes, self.kernel_size, self.stride, self.padding, self.padding_end, self.dilation))

    def output_spec(self, specs):
        x = require_volume(specs[0], self.nd)
        if x.shape[0] != self.in_channels:
            raise ValueError(f"input 0 has {x.shape[0]} channels, expected in_channels={self.in_channels}")
        out = self._out_sizes(x.shape[1:])
        if min(out) < 1:
            raise ValueError(f"the output would be empty: input size {x.shape[1:]} gives {out} with kernel "
                             f"{self.kernel_size}, stride {self.stride}, padding {self.padding}, "
                             f"dilation {self.dilation}")
        return Spec((self.out_channels,) + out)

    # ------------------------------------------------------------------ shared pieces
    def _geometry(self, grid):
        """The vol2col geometry for a window grid, as 3-D tuples (a 2-D layer has depth 1)."""
        pad = (1,) * (3 - self.nd)
        z = (0,) * (3 - self.nd)
        return (pad + self.kernel_size, pad + self.stride, z + self.padding, pad + self.dilation,
                pad + tuple(grid))

    def _volume(self, a):
        """A sample [C, *spatial] as [C, D, H, W]."""
        return a.reshape((a.shape[0],) + (1,) * (4 - a.ndim) + a.shape[1:])

    def _weight_groups(self):
        """The weight as [groups, rows, cols]: conv [out_g, in_g·K], transposed [in_g, out_g·K]."""
        w = self.weight.buffer
        return w.reshape(self.groups, w.shape[0] // self.groups, -1)

    def _grad_groups(self, grad):
        return grad.reshape(self.groups, grad.shape[0] // self.groups, -1)

    def _bias_forward(self, ctx):
        if self.has_bias:
            ctx.be.channel_bias(ctx.output, self.bias.buffer)

    def _bias_backward(self, ctx):
        if self.has_bias:
            db = ctx.param_grad("bias")
            if db is not None:
                ctx.be.channel_bias_grad(ctx.grad_output, db.array, db.beta)

    # The samples of a batch are independent convolutions, each a chain of small GEMMs and
    # copies; on the CPU backend they are split between the threads (lamina.threads.split_work),
    # each thread with its own column buffer and single-threaded kernels, instead of waking a
    # team of threads for every block. Weight gradients: the first thread adds into the
    # parameter's gradient, the others into their own buffers, summed at the end.
    def _threads(self, ctx):
        return min(get_num_threads(), ctx.inputs[0].shape[0]) if ctx.be.name == "cpu" else 1

    def _grad_setup(self, ctx):
        """(weight-gradient target, input-gradient target, threads, per-thread weight parts)."""
        dw, dx = ctx.param_grad("weight"), ctx.input_grad(0)
        threads = self._threads(ctx)
        return dw, dx, threads, self._weight_grad_parts(ctx, dw, threads)

    def _thread_start(self, ctx, t, col_rows, grid, parts):
        """Thread t's column blocks, its weight-gradient part by groups and that part's first beta."""
        part, beta = parts[t]
        return _Blocks(ctx, col_rows, grid, ("col", t)), (self._grad_groups(part) if part is not None else None), beta

    def _weight_grad_parts(self, ctx, dw, threads):
        """Per thread, (array, beta of its first write): the gradient itself for thread 0."""
        if dw is None:
            return [(None, 0.0)] * threads
        return [(dw.array, dw.beta)] + [(ctx.workspace(("dweight", t), dw.array.shape), 0.0)
                                        for t in range(1, threads)]

    def _sum_weight_grad_parts(self, ctx, parts):
        for part, _ in parts[1:]:
            ctx.be.axpby(1.0, part, 1.0, parts[0][0])


# direct_conv.h reads up to two float vectors past the end of each output row's input, and the
# weight gradient reads dy in whole vectors: the padded copies leave that much room
ROW_SLACK = 16
DY_ROW_MULTIPLE = 8


# vol2col works on blocks of window rows so that a block of the column matrix (about this many
# values) stays in cache between being written and being read by the GEMM. Measured on the bench's
# transposed cases (2 threads, min of 18 calls, ms fwd+bwd): 2^18 A 27.3 C 13.6; 2^19 A 25.7 C 13.0;
# 2^20 A 27.7 C 13.0; 2^21 A 34.1 C 13.9 (fewer, larger blocks until the block leaves the cache).
COL_BLOCK = 1 << 19


class _Blocks:
    """The column-matrix blocks of one convolution: window rows [r0, r1) of a grid, a buffer
    sized for the largest block, and each block's [rows, columns] view of it."""

    def __init__(self, ctx, col_rows, grid, key="col"):
        self.grid, self.rows = grid, col_rows
        per_row = col_rows * grid[-1]
        self.step = max(1, COL_BLOCK // per_row)
        total = int(np.prod(grid[:-1]))
        self.ranges = [(r0, min(total, r0 + self.step)) for r0 in range(0, total, self.step)]
        self.buffer = ctx.workspace(key, (col_rows * min(self.step, total) * grid[-1],))

    def __iter__(self):
        width = self.grid[-1]
        for r0, r1 in self.ranges:
            cols = (r1 - r0) * width
            yield (r0, r1), slice(r0 * width, r1 * width), self.buffer[:self.rows * cols].reshape(self.rows, cols)


class _Conv(_ConvNd):
    """y = conv(x, W) + b (cross-correlation, as PyTorch).

    A 3-D convolution with depth stride 1 (the common case) runs as kd accumulated GEMMs over a
    2-D column matrix: with stride 1 the depth taps only shift which input depth slices an output
    slice reads, and each slice's columns are one contiguous block, so the column matrix needs
    only the kh·kw taps of every input slice. That is kd times less data to build than the full
    3-D column matrix (measured 2.4x faster forward on 16->32 channels, 32^3, kernel 3)."""

    def _depth_taps(self, ctx):
        # the tap-major weight copy is a numpy layout change: the CPU backend only
        return (self.nd == 3 and self.stride[0] == 1 and self.kernel_size[0] > 1 and ctx.be.name == "cpu"
                and self.symmetric)

    # ---------------------------------------------------------------- direct forward
    # With unit stride along the width, the CPU backend runs the forward without a column matrix
    # (pyx/direct_conv.h: 4 output channels x 2 vectors of widths per register tile, weights
    # packed in reading order, cached per weight version), and with unit strides everywhere the
    # input gradient too.
    def _direct(self, ctx):
        return ctx.be.name == "cpu" and self.stride[-1] == 1 and self.symmetric

    def _direct_weights(self, which):
        """The weight packed for direct_conv.h, cached per weight version: 'forward', or 'input
        grad' (the input gradient of a stride-1 convolution is the convolution of dy with the
        kernel flipped and its in/out channels swapped, per group)."""
        w = self.weight
        cache = self.__dict__.setdefault("_direct_cache", {})
        key = (which, w.version, id(w.buffer))
        packed = cache.get(key)  # one lookup: another thread may clear the cache meanwhile
        if packed is None:
            out_g, in_g = self.out_channels // self.groups, self.in_channels // self.groups
            taps = int(np.prod(self.kernel_size))
            groups = w.buffer.reshape(self.groups, out_g, in_g, taps)
            if which == "input grad":
                groups = groups[..., ::-1].transpose(0, 2, 1, 3)  # flipped taps, [groups, in_g, out_g, taps]
                out_g, in_g = in_g, out_g
            block = _kernels.direct_conv_block()
            blocks = (out_g + block - 1) // block
            padded = np.zeros((self.groups, blocks * block, in_g, taps), w.buffer.dtype)
            padded[:, :out_g] = groups
            packed = padded.reshape(self.groups, blocks, block, in_g, taps).transpose(0, 1, 3, 4, 2)
            packed = np.ascontiguousarray(packed).reshape(-1)
            if len(cache) > 4:
                cache.clear()
            cache[key] = packed
        return packed

    def _padded_shape(self, batch, padding):
        """The scratch a sample of `batch` is padded into for direct_conv.h: zeros around it, and
        ROW_SLACK more past each row for the last tile's vector loads."""
        c, d, h, w = self._volume(batch[0]).shape
        return c, d + 2 * padding[0], h + 2 * padding[1], w + 2 * padding[2] + ROW_SLACK

    def _direct_run(self, ctx, which, src, dst, padding, stride, dilation, beta=0.0):
        """dst[n] = (beta·dst[n] +) direct_conv(src[n]) for every sample, split between threads."""
        be, packed = ctx.be, self._direct_weights(which)
        kernel = self._geometry(dst.shape[2:])[0]
        padded = self._padded_shape(src, padding)

        def work(t, samples):
            xp = ctx.workspace(("padded", t), padded)
            tmp = ctx.workspace(("direct_out", t), dst.shape[1:]) if beta else None
            for n in samples:
                out = tmp if beta else dst[n]
                _kernels.direct_conv(self._volume(src[n]), packed, self._volume(out), xp, self.groups, *kernel,
                                     *stride[:2], *padding, *dilation)
                if beta:
                    be.axpby(1.0, out, beta, dst[n])
        split_work(src.shape[0], work, self._threads(ctx))

    def _forward_direct(self, ctx):
        _, stride, padding, dilation, _ = self._geometry(ctx.output.shape[2:])
        self._direct_run(ctx, "forward", ctx.inputs[0], ctx.output, padding, stride, dilation)
        self._bias_forward(ctx)

    def _flipped_padding(self, ctx):
        """The padding of the input gradient as a direct convolution of dy (all strides 1, and
        dilation·(k - 1) - padding not negative), or None when it is not one."""
        if not (self._direct(ctx) and max(self.stride) == 1):
            return None
        kernel, _, padding, dilation, _ = self._geometry(ctx.grad_output.shape[2:])
        flipped = tuple(d * (k - 1) - p for k, p, d in zip(kernel, padding, dilation))
        return flipped if min(flipped) >= 0 else None

    def _input_grad(self, ctx):
        """The input-gradient target the column paths should fill: None when the gradient is not
        wanted or was computed here by the direct kernel."""
        dx, flipped = ctx.input_grad(0), self._flipped_padding(ctx)
        if dx is None or flipped is None:
            return dx
        _, _, _, dilation, _ = self._geometry(ctx.grad_output.shape[2:])
        self._direct_run(ctx, "input grad", ctx.grad_output, dx.array, flipped, (1, 1, 1), dilation, dx.beta)
        return None

    def _backward_direct(self, ctx):
        """Weight gradient by direct_conv.h's direct_conv_dw (kernel width <= 3), each thread adding
        its samples into its own part; input gradient by the direct kernel too."""
        be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
        kernel, stride, padding, dilation, _ = self._geometry(dy.shape[2:])
        _, _, threads, parts = self._grad_setup(ctx)
        self._input_grad(ctx)
        xp_shape = self._padded_shape(x, padding)
        out = self._volume(dy[0]).shape
        dyp_shape = out[:3] + (-(-out[3] // DY_ROW_MULTIPLE) * DY_ROW_MULTIPLE,)
        partials = _kernels.direct_conv_dw_workspace(self.in_channels // self.groups, self.out_channels // self.groups,
                                                     *kernel, dy.dtype == np.float32)

        def work(t, samples):
            part, beta = parts[t]
            if beta == 0:
                be.fill(part, 0)
            xp = ctx.workspace(("padded", t), xp_shape)
            dyp = ctx.workspace(("padded dy", t), dyp_shape)
            scratch = ctx.workspace(("dw partials", t), (partials,))
            for n in samples:
                _kernels.direct_conv_dw(self._volume(x[n]), self._volume(dy[n]), part.reshape(-1), xp, dyp, scratch,
                                        self.groups, *kernel, *stride[:2], *padding, *dilation)
        split_work(x.shape[0], work, threads)
        self._sum_weight_grad_parts(ctx, parts)
        self._bias_backward(ctx)

    def _direct_weight_grad(self, ctx):
        # (not ctx.param_grad: asking for the target marks the gradient as written)
        return (self._direct(ctx) and self.kernel_size[-1] <= _kernels.direct_conv_dw_max_width()
                and not self.weight.frozen
                and (ctx.input_grad(0) is None or self._flipped_padding(ctx) is not None))

    def forward(self, ctx):
        if self._direct(ctx):
            return self._forward_direct(ctx)
        if self._depth_taps(ctx):
            return self._forward_depth_taps(ctx)
        be, x, y = ctx.be, ctx.inputs[0], ctx.output
        grid = y.shape[2:]
        geometry = self._geometry(grid)
        w = self._weight_groups()
        k_rows, out_g = w.shape[2], self.out_channels // self.groups
        col_rows = self.in_channels * int(np.prod(self.kernel_size))

        def work(t, samples):
            blocks = _Blocks(ctx, col_rows, geometry[4], ("col", t))
            for n in samples:
                xn, yn = self._volume(x[n]), y[n].reshape(self.out_channels, -1)
                for rows, cols, col in blocks:
                    be.vol2col(xn, col, geometry, rows)
                    for g in range(self.groups):
                        be.gemm(w[g], col[g * k_rows:(g + 1) * k_rows], yn[g * out_g:(g + 1) * out_g, cols])
        split_work(x.shape[0], work, self._threads(ctx))
        self._bias_forward(ctx)

    def backward(self, ctx):
        if self._direct_weight_grad(ctx):
            return self._backward_direct(ctx)
        if self._depth_taps(ctx):
            return self._backward_depth_taps(ctx)
        be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
        geometry = self._geometry(dy.shape[2:])
        w = self._weight_groups()
        k_rows, out_g = w.shape[2], self.out_channels // self.groups
        col_rows = self.in_channels * int(np.prod(self.kernel_size))
        dw, dx, threads, parts = self._grad_setup(ctx)
        dx = self._input_grad(ctx)

        def work(t, samples):
            blocks, dwg, beta = self._thread_start(ctx, t, col_rows, geometry[4], parts)
            for n in samples:
                dyn, xn = dy[n].reshape(self.out_channels, -1), self._volume(x[n])
                if dx is not None:
                    dxn = self._volume(dx.array[n])
                    if dx.beta == 0:
                        be.fill(dxn, 0)
                for rows, cols, col in blocks:
                    if dwg is not None:  # dW_g += dy_g col_gᵀ
                        be.vol2col(xn, col, geometry, rows)
                        for g in range(self.groups):
                            be.gemm(dyn[g * out_g:(g + 1) * out_g, cols], col[g * k_rows:(g + 1) * k_rows], dwg[g],
                                    trans_b=True, beta=beta)
                        beta = 1.0
                    if dx is not None:  # dx += col2vol(W_gᵀ dy_g)
                        for g in range(self.groups):
                            be.gemm(w[g], dyn[g * out_g:(g + 1) * out_g, cols], col[g * k_rows:(g + 1) * k_rows],
                                    trans_a=True)
                        be.col2vol(col, dxn, geometry, rows)
        split_work(x.shape[0], work, threads)
        if dw is not None:
            self._sum_weight_grad_parts(ctx, parts)
        self._bias_backward(ctx)

    # ---------------------------------------------------------------- depth taps (stride_d = 1)
    def _slabs(self, ctx, key="col2d"):
        """Blocks of output depth slices [o0, o1), each with the input slices [i_lo, i_hi) it
        reads (its own plus a halo of (kd - 1)·dd), a column-matrix view for those input slices,
        and the taps (a, od0, od1, first column slice) that land in the block. Blocks keep the
        column matrix in cache; the halo is rebuilt per block, so blocks span several slices."""
        depth, out_depth = ctx.inputs[0].shape[2], ctx.output.shape[2]
        kd, pd, dd = self.kernel_size[0], self.padding[0], self.dilation[0]
        col_rows = self.in_channels * self.kernel_size[1] * self.kernel_size[2]
        plane = int(np.prod(ctx.output.shape[3:]))
        halo = (kd - 1) * dd
        slab = max(COL_BLOCK // (col_rows * plane), 4 * halo, 1)
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

    def _tap_weights(self):
        """The weight as [kd, groups, out_g, in_g·kh·kw] (a layout copy, rebuilt when it changes)."""
        w = self.weight
        cached = getattr(self, "_tap_cache", None)
        if cached is None or cached[0] != (w.version, id(w.buffer)):
            kd, k2 = self.kernel_size[0], self.kernel_size[1] * self.kernel_size[2]
            out_g, in_g = self.out_channels // self.groups, self.in_channels // self.groups
            taps = w.buffer.reshape(self.groups, out_g, in_g, kd, k2).transpose(3, 0, 1, 2, 4)
            self._tap_cache = cached = ((w.version, id(w.buffer)),
                                        np.ascontiguousarray(taps).reshape(kd, self.groups, out_g, in_g * k2))
        return cached[1]

    def _plane_geometry(self, ctx):
        """vol2col over input depth slices with the kh·kw taps only."""
        depth, grid = ctx.inputs[0].shape[2], ctx.output.shape[3:]
        return ((1,) + self.kernel_size[1:], (1,) + self.stride[1:], (0,) + self.padding[1:],
                (1,) + self.dilation[1:], (depth,) + tuple(grid))

    def _forward_depth_taps(self, ctx):
        be, x, y = ctx.be, ctx.inputs[0], ctx.output
        geometry, out_h = self._plane_geometry(ctx), y.shape[3]
        wt = self._tap_weights()
        rows, out_g = wt.shape[3], self.out_channels // self.groups

        def work(t, samples):
            for n in samples:
                yn = y[n].reshape(self.out_channels, -1)
                be.fill(yn, 0)
                for (i_lo, i_hi), col, taps in self._slabs(ctx, ("col2d", t)):
                    be.vol2col(x[n], col, geometry, (i_lo * out_h, i_hi * out_h))
                    for a, out_cols, col_cols in taps:
                        for g in range(self.groups):
                            be.gemm(wt[a, g], col[g * rows:(g + 1) * rows, col_cols],
                                    yn[g * out_g:(g + 1) * out_g, out_cols], beta=1.0)
        split_work(x.shape[0], work, self._threads(ctx))
        self._bias_forward(ctx)

    def _backward_depth_taps(self, ctx):
        be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
        geometry, out_h = self._plane_geometry(ctx), dy.shape[3]
        wt = self._tap_weights()
        rows, out_g = wt.shape[3], self.out_channels // self.groups
        dw, dx = ctx.param_grad("weight"), self._input_grad(ctx)
        threads = self._threads(ctx)
        # tap-major weight gradients, one per thread, all starting from zero
        dwts = [ctx.workspace(("dweight_taps", t), wt.shape) for t in range(threads)] if dw is not None else None

        def work(t, samples):
            dwt = dwts[t] if dwts is not None else None
            if dwt is not None:
                be.fill(dwt, 0)
            for n in samples:
                dyn = dy[n].reshape(self.out_channels, -1)
                if dx is not None and dx.beta == 0:
                    be.fill(dx.array[n], 0)
                for (i_lo, i_hi), col, taps in self._slabs(ctx, ("col2d", t)):
                    window = (i_lo * out_h, i_hi * out_h)
                    if dwt is not None:  # dW_a,g += dy_g[output slices] col_g[their input slices]ᵀ
                        be.vol2col(x[n], col, geometry, window)
                        for a, out_cols, col_cols in taps:
                            for g in range(self.groups):
                                be.gemm(dyn[g * out_g:(g + 1) * out_g, out_cols],
                                        col[g * rows:(g + 1) * rows, col_cols], dwt[a, g], trans_b=True, beta=1.0)
                    if dx is not None:  # dcol[input slices] += W_a,gᵀ dy_g[output slices]; dx += col2vol(dcol)
                        be.fill(col, 0)
                        for a, out_cols, col_cols in taps:
                            for g in range(self.groups):
                                be.gemm(wt[a, g], dyn[g * out_g:(g + 1) * out_g, out_cols],
                                        col[g * rows:(g + 1) * rows, col_cols], trans_a=True, beta=1.0)
                        be.col2vol(col, dx.array[n], geometry, window)
        split_work(x.shape[0], work, threads)
        if dwts is not None:  # back to PyTorch's layout [out, in_g, kd, kh, kw] (a layout copy)
            dwt = dwts[0]
            for other in dwts[1:]:
                be.axpby(1.0, other, 1.0, dwt)
            kd, k2 = self.kernel_size[0], self.kernel_size[1] * self.kernel_size[2]
            in_g = self.in_channels // self.groups
            back = dwt.reshape(kd, self.groups, out_g, in_g, k2).transpose(1, 2, 3, 0, 4).reshape(dw.array.shape)
            if dw.beta == 0:
                dw.array[...] = back
            else:
                dw.array[...] += back
        self._bias_backward(ctx)


class _ConvTranspose(_ConvNd):
    """The adjoint of a convolution: y = col2vol(Wᵀ x) + b, output size
    (n - 1)·stride - 2·padding + dilation·(k - 1) + output_padding + 1."""

    transposed = True

    def forward(self, ctx):
        be, x, y = ctx.be, ctx.inputs[0], ctx.output
        geometry = self._geometry(x.shape[2:])
        w = self._weight_groups()  # [groups, in_g, out_g·K]
        in_g, k_rows = w.shape[1], w.shape[2]
        col_rows = self.out_channels * int(np.prod(self.kernel_size))

        def work(t, samples):
            blocks = _Blocks(ctx, col_rows, geometry[4], ("col", t))
            for n in samples:
                xn, yn = x[n].reshape(self.in_channels, -1), self._volume(y[n])
                be.fill(yn, 0)
                for rows, cols, col in blocks:
                    for g in range(self.groups):
                        be.gemm(w[g], xn[g * in_g:(g + 1) * in_g, cols], col[g * k_rows:(g + 1) * k_rows],
                                trans_a=True)
                    be.col2vol(col, yn, geometry, rows)
        split_work(x.shape[0], work, self._threads(ctx))
        self._bias_forward(ctx)

    def backward(self, ctx):
        be, x, dy = ctx.be, ctx.inputs[0], ctx.grad_output
        geometry = self._geometry(x.shape[2:])
        w = self._weight_groups()
        in_g, k_rows = w.shape[1], w.shape[2]
        col_rows = self.out_channels * int(np.prod(self.kernel_size))
        dw, dx, threads, parts = self._grad_setup(ctx)

        def work(t, samples):
            blocks, dwg, beta = self._thread_start(ctx, t, col_rows, geometry[4], parts)
            for n in samples:
                xn, dyn = x[n].reshape(self.in_channels, -1), self._volume(dy[n])
                dxn = dx.array[n].reshape(self.in_channels, -1) if dx is not None else None
                for rows, cols, col in blocks:
                    be.vol2col(dyn, col, geometry, rows)
                    for g in range(self.groups):
                        colg = col[g * k_rows:(g + 1) * k_rows]
                        if dxn is not None:  # dx_g = W_g dcol_g (blocks of columns are disjoint)
                            be.gemm(w[g], colg, dxn[g * in_g:(g + 1) * in_g, cols], beta=dx.beta)
                        if dwg is not None:  # dW_g += x_g dcol_gᵀ
                            be.gemm(xn[g * in_g:(g + 1) * in_g, cols], colg, dwg[g], trans_b=True, beta=beta)
                    beta = 1.0
        split_work(x.shape[0], work, threads)
        if dw is not None:
            self._sum_weight_grad_parts(ctx, parts)
        self._bias_backward(ctx)


@register
class Conv3d(_Conv):
    kind = "conv3d"
    nd = 3

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, name=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias, name=name)


@register
class Conv2d(Conv3d):
    kind = "conv2d"
    nd = 2


@register
class ConvTranspose3d(_ConvTranspose):
    kind = "conv_transpose3d"
    nd = 3

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, output_padding=0,
                 groups=1, bias=True, dilation=1, name=None):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         output_padding, name=name)


@register
class ConvTranspose2d(ConvTranspose3d):
    kind = "conv_transpose2d"
    nd = 2
