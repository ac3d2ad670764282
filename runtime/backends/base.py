"""The kernel interface every backend implements; layers call only these methods.

Arrays are the backend's own (numpy on the CPU, pyopencl arrays on OpenCL), C-contiguous, of the
network's float type (float32, or float64 for gradient checks); labels are int32.

Two rules hold for every kernel:
- "with beta": out = result + beta * out; beta == 0 overwrites and never reads out (which may hold
  garbage), as BLAS treats C. The scheduler passes 0 to the first writer of a gradient and 1 to
  every later one, so gradients add up without zero-fill passes.
- kernels write into outputs the caller allocated; none allocates in the hot path.

Two kinds of method:
- the **core kernels** (`@abstractmethod`, listed in CORE_KERNELS): arrays, GEMM, element-wise
  kernels and reductions, gathers and scatters, sequence pooling, vol2col/col2vol, the fused
  recurrent cells and the optimizer updates. A backend must implement these and nothing else;
- the **composed operations**: every other method, written here from the core kernels (packed
  GEMM as a snapshot and a GEMM, biases as channel biases, column copies and row updates from
  gathers and scatters, the dense costs from activations, gathers and GEMMs against a vector of
  ones, the convolutions from vol2col and GEMM, the recurrence from GEMMs and cells). A backend
  overrides one only where its own kernel measures faster (bench/overrides.py times each
  override against the composed form on the same backend).

Composed operations take their temporary arrays from `Backend.scratch`: one buffer per name and
thread, grown to the largest size asked for, so they allocate only while sizes grow.
"""
from __future__ import annotations

import math
import sys
import threading
from abc import ABC, abstractmethod
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

from . import columns, stepwise
from ..precision import ACTIVATION_LEVELS, WEIGHT_LEVELS, check_int8_pack, check_precision

# position = the activation's code in the compiled kernels. `slope` is leaky_relu's negative
# slope, elu's alpha and hard_sigmoid's alpha (hard_sigmoid's beta is 0.5; selu's constants are
# the standard ones); gelu is the exact (erf) form, gelu_tanh its tanh approximation
# (0.5 x (1 + tanh(√(2/π) (x + 0.044715 x³)))); hard_swish is x · hard_sigmoid(x) with 1/6;
# bounded_relu is min(max(x, 0), slope) (ReLU6 with slope 6; its gradient is 1 strictly between
# the bounds, as PyTorch's hardtanh); sqrt, reciprocal, log, abs and erf are the functions (NaN
# outside their domain, as numpy's), abs's gradient sign(x) (0 at 0, as PyTorch's)
ACTIVATIONS = ("linear", "sigmoid", "tanh", "relu", "leaky_relu", "exponential", "softrelu", "elu", "selu",
               "softsign", "hard_sigmoid", "gelu", "hard_swish", "gelu_tanh", "bounded_relu", "sqrt", "reciprocal",
               "log", "abs", "erf")
# their derivative is not a function of the output: backward takes the input x instead of y
INPUT_GRAD_ACTIVATIONS = ("gelu", "hard_swish", "gelu_tanh", "log", "abs", "erf")
# softmax and log_softmax normalise along each row, so they are not element-wise; they share the
# activation API
ROW_ACTIVATIONS = ("softmax", "log_softmax")
ALL_ACTIVATIONS = ACTIVATIONS + ROW_ACTIVATIONS
# sequence pooling modes, in the compiled kernels' order
POOL_MODES = ("last", "first", "average", "sum", "max")


def check_activation(kind, where):
    if kind not in ALL_ACTIVATIONS:
        raise ValueError(f"{where}: unknown activation {kind!r}; expected one of {', '.join(ALL_ACTIVATIONS)}")
    return kind


class Backend(ABC):
    """One device's arrays and kernels (see the module docstring for the conventions)."""

    name = "abstract"
    # to_host returns the array itself (the backend's arrays are host memory), not a copy
    host_arrays = False

    # -- arrays
    @abstractmethod
    def empty(self, shape, dtype): ...

    def zeros(self, shape, dtype):
        a = self.empty(shape, dtype)
        self.fill(a, 0)
        return a

    @abstractmethod
    def fill(self, a, value): ...

    @abstractmethod
    def from_host(self, array): ...

    @abstractmethod
    def to_host(self, a): ...

    @abstractmethod
    def copy(self, src, dst): ...

    # -- products
    @abstractmethod
    def gemm(self, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        """c = alpha * op(a) @ op(b) + beta * c."""

    def gemm_in(self, precision, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        """gemm with both operands in `precision` ('float32', or 'bfloat16': rounded to bfloat16,
        products summed in float32; lamina.precision). Here the rounded operands in scratch
        buffers and one float32 GEMM."""
        a, b = self._operands_in(precision, "gemm_in", a=a, b=b)
        self.gemm(a, b, c, trans_a, trans_b, alpha, beta)

    def gemm_bias(self, a, b, c, bias, trans_a=False, trans_b=False):
        """c = op(a) @ op(b) + bias (added to every row of c): a Linear layer's forward."""
        self.gemm(a, b, c, trans_a, trans_b)
        self.add_bias(c, bias)

    def pack(self, b, trans=False, alpha=1.0, max_rows=1, precision="float32"):
        """A packed form of alpha * op(b) for packed_gemm; a snapshot of b's values. With
        precision 'bfloat16' or 'int8' the products from it multiply in that precision
        (lamina.precision); an int8 pack quantizes per output channel, which are b's rows, so it
        takes b as [n, k] with trans=True (a layer's [out, in] weight). Here a copy of b (rounded
        to bfloat16, or its int8 integers with their scales) with alpha and trans beside it, and
        packed_gemm is one GEMM of a in that precision."""
        check_precision(precision, "pack")
        if b.ndim != 2 or 0 in b.shape:
            raise ValueError(f"pack: b must be a non-empty 2-D array, found shape {b.shape}")
        check_int8_pack(precision, b, trans)
        snapshot, scales = self.empty(b.shape, b.dtype), None
        if precision == "int8":
            scales = self.empty((b.shape[0],), b.dtype)
            self.quantize_rows(b, snapshot, scales, WEIGHT_LEVELS, symmetric=True)
        else:
            self.copy(b, snapshot)
        if precision == "bfloat16":
            self.round_to_bfloat16(snapshot, snapshot)
        return Snapshot(snapshot, trans, alpha, precision, scales)

    def packed_gemm(self, a, packed, c, beta=0.0):
        """c = a @ packed + beta * c."""
        if a.ndim != 2 or a.shape[1] != packed.k:
            raise ValueError(f"packed_gemm: a must have {packed.k} columns, found shape {a.shape}")
        if packed.precision == "int8":
            return self._int8_product(a, packed, c, beta)
        if packed.precision == "bfloat16":
            rounded = self.scratch("packed_gemm bfloat16", a.shape, a.dtype)
            self.round_to_bfloat16(a, rounded)
            a = rounded
        self.gemm(a, packed.b, c, trans_b=packed.trans, alpha=packed.alpha, beta=beta)

    def _int8_product(self, a, packed, c, beta):
        """c = alpha (qa @ qbᵀ) * (scale of a's row x scale of b's channel) + beta c: a's rows
        quantized, one GEMM of the integers (exact in float32 while a sum stays below 2^24), and
        the outer product of the two scales multiplied in."""
        m, n = a.shape[0], packed.n
        qa = self.scratch("int8 rows", a.shape, a.dtype)
        row_scales = self.scratch("int8 row scales", (m,), a.dtype)
        self.quantize_rows(a, qa, row_scales, ACTIVATION_LEVELS)
        sums = self.scratch("int8 sums", (m, n), a.dtype)
        self.gemm(qa, packed.b, sums, trans_b=True)
        scales = self.scratch("int8 scales", (m, n), a.dtype)
        self.gemm(row_scales.reshape(m, 1), packed.scales.reshape(1, n), scales, alpha=packed.alpha)
        self.multiply(sums, scales, c, beta)

    def packed_gemm_bias(self, a, packed, c, bias):
        """c = a @ packed + bias (added to every row of c)."""
        self.packed_gemm(a, packed, c)
        self.add_bias(c, bias)

    def packs_fixed_weights(self, m, k, n):
        """For an m x k by k x n product with a weight that stays fixed over many calls
        (inference): the rows (at least m) to pack the weight for (Backend.pack) where the product
        runs faster from that pack, else 0 (compute from the weight itself): 0, here."""
        return 0

    # -- bias, element-wise, rows
    def add_bias(self, y, b):
        """y[i, :] += b (b along y's last axis): a channel bias over y's rows."""
        self.channel_bias(y.reshape(y.size // b.shape[0], b.shape[0]), b, 1.0)

    def bias_grad(self, dy, db, beta=0.0):
        """db = column sums of dy viewed as [rows, features] (with beta)."""
        self.channel_bias_grad(dy.reshape(dy.shape[0], -1), db, beta)

    @abstractmethod
    def activation(self, kind, x, y, slope=0.01):
        """y = f(x) (may be in place); softmax along the last axis."""

    @abstractmethod
    def activation_backward(self, kind, y, dy, dx, beta=0.0, slope=0.01):
        """dx = dy * f'(x) (with beta), f' written in terms of y = f(x); for the kinds in
        INPUT_GRAD_ACTIVATIONS the second argument is x itself."""

    @abstractmethod
    def axpby(self, alpha, x, beta, y):
        """y = alpha * x + beta * y."""

    @abstractmethod
    def multiply(self, a, b, out, beta=0.0):
        """out = a * b (with beta), element-wise."""

    @abstractmethod
    def select(self, cond, a, b, out):
        """out = a where cond > 0, else b (NaN in cond: b), element-wise (ONNX's Where, with the
        condition as a float). cond has out's shape; a and b have it too, or hold one row that
        every row of out reads (size out.size // out.shape[0]). out may be b's array, never a's
        (a backend may write b into out first). Check the sizes with `select_sizes`."""

    @abstractmethod
    def round_to_bfloat16(self, x, y):
        """y = x rounded to the nearest bfloat16 value (ties to even; NaN stays NaN), in x's
        float32 type (y may be x)."""

    @abstractmethod
    def quantize_rows(self, x, q, scales, levels, symmetric=False):
        """Each row of x (2-D float32) as integers q (float32, x's shape) times scales[row]
        (lamina.precision.quantize_rows: symmetric in [-levels, levels], or a zero point and the
        row's range in `levels` steps, q then the u8 value less its zero point)."""

    @abstractmethod
    def sum_squares(self, x, rows=None):
        """sum of x**2 as a host float; with rows (int32), of those rows of x only."""

    # whether reading a value back waits for the device's queue to drain: then the optimizers
    # check every gradient of a step with one read (sums_of_squares), after the last one is done
    reads_wait = False

    def sums_of_squares(self, arrays):
        """[sum_squares(x, rows) for (x, rows) in arrays]; a backend whose reads wait for its queue
        reads them all at once."""
        return [self.sum_squares(x, rows) for x, rows in arrays]

    def copy_to_columns(self, src, dst, col, beta=0.0):
        """dst[:, col:col + src.shape[1]] = src (with beta): a scatter of every row."""
        self.scatter_rows(src, self.arange(src.shape[0]), dst, beta, col)

    def copy_from_columns(self, src, col, dst, beta=0.0):
        """dst = src[:, col:col + dst.shape[1]] (with beta): a gather of every row."""
        if beta == 0:
            self.gather_rows(src, self.arange(dst.shape[0]), dst, col)
            return
        block = self.scratch("copy_from_columns", dst.shape, dst.dtype)
        self.gather_rows(src, self.arange(dst.shape[0]), block, col)
        self.axpby(1.0, block, beta, dst)

    @abstractmethod
    def gather_rows(self, src, index, dst, col=0):
        """dst[i] = src[index[i], col:col+k] (sequence batches into time-major order)."""

    @abstractmethod
    def scatter_rows(self, src, index, dst, beta=0.0, col=0):
        """dst[index[i], col:col+k] = src[i] (with beta); index holds no repeats."""

    @abstractmethod
    def scatter_add_rows(self, src, ids, dst):
        """dst[ids[i]] += src[i]; ids may repeat (embedding gradients)."""

    def fill_rows(self, dst, rows, value):
        """dst[rows] = value: a filled block scattered to the rows."""
        if len(rows) == 0:
            return
        block = self.scratch("fill_rows", (len(rows),) + tuple(dst.shape[1:]), dst.dtype)
        self.fill(block, value)
        self.scatter_rows(block, rows, dst)

    def sgd_update_rows(self, p, g, v, rows, lr, momentum=0.0, dampening=0.0, nesterov=False):
        """sgd_update (no weight decay) on the listed rows only: exact for a gradient that is zero
        elsewhere without momentum; with momentum the lazy form (other rows keep v and p).
        Here the rows are gathered, updated by sgd_update and scattered back."""
        with self._rows_of(rows, p=p, g=g, **({"v": v} if momentum else {})) as part:
            self.sgd_update(part["p"], part["g"], part.get("v"), lr, momentum, dampening, nesterov, 0.0)

    def adam_update_rows(self, p, g, m, v, rows, lr, beta1, beta2, eps, step):
        """adam_update (no weight decay) on the listed rows only, the lazy form: other rows keep
        their moments and values (gathered, updated by adam_update, scattered back)."""
        with self._rows_of(rows, p=p, g=g, m=m, v=v) as part:
            self.adam_update(part["p"], part["g"], part["m"], part["v"], lr, beta1, beta2, eps, 0.0, False, step)

    def adagrad_update_rows(self, p, g, s, rows, lr, eps):
        """AdaGrad on the listed rows only (exact without weight decay; gathered, updated by
        adagrad_update, scattered back)."""
        with self._rows_of(rows, p=p, g=g, s=s) as part:
            self.adagrad_update(part["p"], part["g"], part["s"], lr, eps, 0.0)

    # -- sequences: starts are the int32 offsets of the batch
    @abstractmethod
    def sequence_pool(self, mode, x, starts, out, argmax):
        """out[s] = last/first/average/sum/max of x's rows of sequence s (argmax: int32, for max)."""

    @abstractmethod
    def sequence_pool_backward(self, mode, dy, starts, argmax, dx, beta=0.0):
        """dx = the pooling's gradient spread back over each sequence's rows (with beta)."""

    @abstractmethod
    def sequence_softmax(self, x, starts, y):
        """y = softmax over each sequence's steps (one value per step)."""

    @abstractmethod
    def sequence_softmax_backward(self, y, dy, starts, dx, beta=0.0):
        """dx = y (dy - Σ dy y) within each sequence (with beta)."""

    # -- attention within sequences, and normalization of rows
    @abstractmethod
    def attention(self, qkv, starts, heads, scale, causal, out, lse):
        """Multi-head attention within each sequence. qkv [rows, 3E] holds every row's query, key
        and value, each `heads` blocks of d = E / heads columns (head h's query is
        qkv[:, h*d:(h+1)*d], its key E columns on, its value 2E on); the rows of sequence s are
        starts[s] .. starts[s+1]. Query i attends to the keys j of its own sequence (j <= i when
        causal): out[i, h*d:(h+1)*d] = Σ_j softmax_j(scale q_i·k_j) v_j, and
        lse[i, h] = log Σ_j exp(scale q_i·k_j) is kept for backward. out [rows, E], lse [rows, heads]."""

    @abstractmethod
    def attention_backward(self, qkv, out, lse, dout, starts, heads, scale, causal, dqkv):
        """dqkv [rows, 3E] = the gradient of attention's out (for dout [rows, E]) with respect to
        qkv, written (not added)."""

    @abstractmethod
    def layer_norm(self, x, gamma, beta, eps, y, mean, rstd, center=True):
        """Each row of x [rows, C] normalised: y = (x - μ) rstd γ + β, μ the row's mean and
        rstd = 1 / sqrt(mean((x - μ)²) + eps); center False (RMSNorm): μ = 0. gamma and beta [C]
        or None (absent); mean and rstd [rows] are kept for backward."""

    @abstractmethod
    def layer_norm_backward(self, x, dy, mean, rstd, gamma, dx=None, dx_beta=0.0, dgamma=None, dgamma_beta=0.0,
                            dbeta=None, dbeta_beta=0.0, center=True):
        """The gradients of layer_norm for dy: dx = rstd (g - mean(g) - x̂ mean(g x̂)) with
        g = dy γ and x̂ = (x - μ) rstd (no mean(g) term without centring), dgamma = Σ_rows dy x̂,
        dbeta = Σ_rows dy, each written with its beta; a target None is not computed."""

    # -- selections (lamina.selection): entry e of row i lies in starts[i] <= e < starts[i + 1];
    #    its column is cols[e] (per-row selections), or cols[e - starts[i]] where `shared`
    @abstractmethod
    def selected_dots(self, x, w, by_column, out, beta=0.0):
        """out[e] = x[row(e)] · w[col(e)] (with beta), for every entry of a per-row selection;
        by_column = (columns, bucket_starts, entries, entry_rows), Selection.by_column's CSC."""

    @abstractmethod
    def selected_backward(self, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        """dx[i] = Σ_e g[e] w[col(e)] over row i's entries (with dx_beta), and
        dw[c] = Σ_e g[e] x[row(e)] over column c's entries for each selected column c (with
        dw_beta; other rows of dw untouched); either output may be None."""

    def selected_dots_in(self, precision, x, w, by_column, out, beta=0.0):
        """selected_dots with x and w in `precision` (as gemm_in: 'float32', or 'bfloat16': rounded
        to bfloat16, products summed in float32). Here the rounded operands in scratch buffers
        and selected_dots."""
        x, w = self._operands_in(precision, "selected_dots_in", x=x, w=w)
        self.selected_dots(x, w, by_column, out, beta)

    def selected_backward_in(self, precision, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        """selected_backward with x and w in `precision` (as selected_dots_in): the gradient g, in
        float32, times their rounded values."""
        x, w = self._operands_in(precision, "selected_backward_in", x=x, w=w)
        self.selected_backward(g, x, w, by_column, dx, dx_beta, dw, dw_beta)

    def _operands_in(self, precision, where, **operands):
        """The operands as a product in `precision` multiplies them: themselves in float32, rounded
        to bfloat16 in scratch buffers (named by `where`) in bfloat16."""
        if precision not in ("float32", "bfloat16"):
            raise ValueError(f"{where}: precision must be float32 or bfloat16, found {precision!r} (int8 products "
                             f"quantize a weight per output channel: pack it, Backend.pack)")
        if precision == "float32":
            return list(operands.values())
        rounded = []
        for name, x in operands.items():
            r = self.scratch(f"{where} bfloat16 {name}", x.shape, x.dtype)
            self.round_to_bfloat16(x, r)
            rounded.append(r)
        return rounded

    @abstractmethod
    def selected_bias_grad(self, g, by_column, db, beta=0.0):
        """db[c] = Σ_e g[e] over the entries of each selected column c (with beta)."""

    def add_selected_bias(self, out, b, cols):
        """out[e] += b[cols[e]]: the bias gathered per entry, then added."""
        picked = self.scratch("add_selected_bias", (len(cols), 1), out.dtype)
        self.gather_rows(b.reshape(b.shape[0], 1), cols, picked)
        self.axpby(1.0, picked.reshape(out.shape), 1.0, out)

    @abstractmethod
    def gather_entries(self, full, starts, cols, shared, out, beta=0.0):
        """out[e] = full[i, col(e)] (with beta)."""

    @abstractmethod
    def scatter_entries(self, g, starts, cols, shared, full):
        """full = 0, then full[i, col(e)] += g[e]."""

    @abstractmethod
    def segment_cross_entropy(self, z, starts, pos, shift, w, probs, cost):
        """probs = softmax(z - shift) within each row's entries (shift None: 0);
        cost[i] = -w[i] log probs[pos[i]]."""

    @abstractmethod
    def segment_cross_entropy_backward(self, probs, starts, pos, w, dcost, dz, beta=0.0):
        """dz[e] = dcost[i] w[i] (probs[e] - [e == pos[i]]) (with beta)."""

    @abstractmethod
    def segment_self_normalized(self, o, starts, pos, alpha, w, cost):
        """cost[i] = w[i] (-log o[pos[i]] + log S_i + alpha (log S_i)²), S_i = Σ_row o."""

    @abstractmethod
    def segment_self_normalized_backward(self, o, starts, pos, alpha, w, dcost, do, beta=0.0):
        """do[e] = dcost[i] w[i] ((1 + 2 alpha log S_i) / S_i - [e == pos[i]] / o[e]) (with beta)."""

    # -- volumes: one sample [C, D, H, W]; geometry = (kernel, stride, padding, dilation, grid),
    #    3-tuples over depth, height, width; grid is the oD x oH x oW window grid
    @abstractmethod
    def vol2col(self, x, col, geometry, rows=None):
        """col[(c,a,b,e), (od,oh,ow)] = x[c, od*s-p+a*d, ...], zero in the padding (overwrites);
        rows=(r0, r1) limits it to the window rows od·oH + oh in [r0, r1)."""

    @abstractmethod
    def col2vol(self, col, x, geometry, rows=None):
        """The adjoint of vol2col: ACCUMULATES every column entry into x."""

    # -- resampling along one axis (Resize): x [outer, n_in, inner] -> y [outer, n_out, inner]; output
    #    position j reads inputs taps[j, k] weighted by weights[j, k] (int32 and x's type, [n_out, K])
    @abstractmethod
    def resample_axis(self, x, taps, weights, y):
        """y[o, j, i] = Σ_k weights[j, k] x[o, taps[j, k], i]."""

    @abstractmethod
    def resample_axis_backward(self, dy, taps, weights, dx, beta=0.0):
        """dx[o, t, i] = Σ_{j, k: taps[j, k] = t} weights[j, k] dy[o, j, i] (with beta)."""

    # -- convolutions as whole algorithms: `geom` is the convolution's ConvGeometry
    #    (lamina.backends.geometry), `weight` its weight Parameter (its buffer, and the derived
    #    layouts an algorithm caches on it). Here vol2col + GEMM from the kernels above
    #    (lamina.backends.columns); a backend with faster algorithms overrides these and picks by
    #    the geometry.
    def conv_algorithms(self, geom):
        """{'forward', 'input grad', 'weight grad'}: the algorithm each step runs with."""
        return dict.fromkeys(("forward", "input grad", "weight grad"), "columns")

    def conv_forward(self, geom, weight, ctx, bias=None, activation=None, pool=None):
        """ctx.output = act(conv(ctx.inputs[0]) + bias), transposed or not: bias [out_channels] or
        None; activation (kind, slope) of an element-wise activation, or None. Here the activation,
        and a plain convolution's bias, are passes of their own after the convolution (a
        transposed one's outputs start from the bias); a backend whose kernels apply them as
        they store the output does so. With pool (a max pool's window, as
        max_pool takes it), ctx.output is the max pool of that: here the convolution goes to a
        workspace of its own shape (ctx.unpooled_shape()) and is pooled from there."""
        if pool is not None:
            full = ctx.workspace("unpooled", ctx.unpooled_shape())
            self.conv_forward(geom, weight, columns.Replaced(ctx, output=full), bias, activation)
            self.max_pool(full, ctx.output, None, pool)
            return
        columns.any_forward(geom, weight, ctx, bias, activation)

    def conv_backward(self, geom, weight, ctx):
        """The weight gradient (ctx.param_grad) and the input gradient (ctx.input_grad)."""
        if geom.transposed:
            columns.transposed_backward(geom, weight, ctx)
        else:
            columns.backward(geom, weight, ctx, ctx.input_grad(0))

    # -- the recurrence of one layer direction over a batch order (lamina.backends.stepwise):
    #    `cell` is the layer, `run` its Direction; here step by step with the layer's cell
    packs_recurrent_weights = False  # whether recurrent layers pack W_hh by default (Backend.pack)

    def recurrence_forward(self, cell, ctx, run):
        """Every step's gates and states, and the states into run.output."""
        stepwise.forward(cell, ctx, run)

    def recurrence_backward(self, cell, ctx, run):
        """Every step's dg and dgh, and the initial states' gradients."""
        stepwise.backward(cell, ctx, run)

    def sample_threads(self, batch):
        """How many host threads share the samples of a batch in the generic convolution (each
        with single-threaded kernels): one, unless the backend's kernels run on the host."""
        return 1

    @abstractmethod
    def channel_bias(self, y, b, beta=1.0):
        """y[n, c, ...] = beta·y[n, c, ...] + b[c]; beta 0 overwrites y (its values not read)."""

    @abstractmethod
    def channel_bias_grad(self, dy, db, beta=0.0):
        """db[c] = sum over n and space of dy[n, c, ...] (with beta)."""

    # -- pooling: x [N, C, *spatial]; window = (kernel, stride, padding[, dilation]), 3-tuples
    # over D, H, W (window_parts reads one)
    @abstractmethod
    def max_pool(self, x, out, argmax, window):
        """out = window maxima; argmax [N·C, out positions] = flat winning position (int32), or
        None where no backward will read it (inference)."""

    @abstractmethod
    def max_pool_backward(self, dy, argmax, dx, beta=0.0, window=None):
        """dx = dy routed to each window's winner, summed (with beta); window is the forward's
        (a backend that gathers per input element needs it)."""

    @abstractmethod
    def avg_pool(self, x, out, window, count_include_pad=True):
        """out = window means (divisor: the window size, or only positions inside the input)."""

    @abstractmethod
    def avg_pool_backward(self, dy, dx, window, count_include_pad=True, beta=0.0):
        """dx = dy spread evenly over each window (with beta)."""

    # -- batch normalisation: x [N, C, *spatial], per-channel float64 statistics
    @abstractmethod
    def batch_norm_stats(self, x, mean, var):
        """Per-channel mean and biased variance over N and space."""

    @abstractmethod
    def stat_dtype(self, dtype):
        """The type of batch-norm statistics for data of `dtype`."""

    @abstractmethod
    def batch_norm_statistics(self, mean, var, invstd, running_mean, running_var, eps, momentum, count, training):
        """Training: invstd = 1/sqrt(var + eps) and running averages r = (1 - momentum) r +
        momentum · stat (the variance unbiased by count/(count - 1)); inference: mean =
        running_mean, invstd = 1/sqrt(running_var + eps)."""

    @abstractmethod
    def add_cast(self, src, dst, beta=0.0):
        """dst = src (converted to dst's type) + beta dst."""

    @abstractmethod
    def batch_norm_apply(self, x, mean, invstd, gamma, beta, y, activation=None):
        """y = act((x - mean) invstd gamma + beta) (gamma None: no affine; activation (kind,
        slope) or None, as conv_forward's)."""

    def activate_in_place(self, activation, y):
        """y = act(y) for activation (kind, slope); None or linear: nothing."""
        if activation is not None and activation[0] != "linear":
            self.activation(activation[0], y, y, activation[1])

    @abstractmethod
    def batch_norm_backward(self, x, dy, mean, invstd, gamma, batch_stats, dx, beta, dgamma, dbeta):
        """dgamma = Σ dy x̂, dbeta = Σ dy (float64); dx (with beta) through batch statistics or
        fixed ones; dx None skips it."""

    # -- recurrent cells, one time step over the B running sequences (PyTorch's gate orders)
    @abstractmethod
    def lstm_step(self, g, c_prev, c, h):
        """g [B, 4H]: pre-activations in, activated i, f, g, o out; c = f c_prev + i g;
        h = o tanh(c). c_prev None means zero."""

    @abstractmethod
    def lstm_step_backward(self, g, c_prev, c, dh, dc, dg, dc_prev):
        """dg = d loss / d pre-activations from dh and the carried cell gradient dc;
        dc_prev += (dc + dh o tanh'(c)) f unless dc_prev is None."""

    @abstractmethod
    def gru_step(self, g, hh, h_prev, h):
        """g [B, 3H] = x W_ihᵀ + b_ih in, activated r, z, n out; hh = h_prev W_hhᵀ + b_hh;
        h = (1 - z) n + z h_prev with n = tanh(g_n + r hh_n)."""

    @abstractmethod
    def gru_step_backward(self, g, hh, h_prev, dh, dgx, dgh, dh_prev):
        """dgx, dgh: gradients of g and hh; dh_prev += dh z unless dh_prev is None."""

    @abstractmethod
    def bernoulli_mask(self, mask, keep, rng):
        """mask = 1/keep with probability keep, else 0 (inverted dropout)."""

    # -- costs: one value per row, optional per-row weights w (None = 1). Here from activations,
    #    gathers and GEMMs against a vector of ones (row sums, and a vector spread over columns)
    def softmax_cross_entropy(self, x, labels, w, probs, cost):
        """probs = softmax(x) (probs None: the costs alone, as inference needs); cost[i] =
        -w[i] log probs[i, labels[i]]."""
        x2 = x.reshape(x.shape[0], -1)
        logp = self.scratch("softmax_cross_entropy", x2.shape, x.dtype)
        self.activation("log_softmax", x2, logp)
        self.gather_entries(logp, self.arange(len(x2) + 1), labels, False, cost)
        self._weigh_rows(-1.0, cost, w, cost)
        if probs is not None:
            self.activation("softmax", x2, probs.reshape(x2.shape))

    def softmax_cross_entropy_backward(self, probs, labels, w, dcost, dx, beta=0.0):
        """dx[i] = dcost[i] w[i] (probs[i] - onehot(labels[i])) (with beta)."""
        p2 = probs.reshape(probs.shape[0], -1)
        diff = self.scratch("softmax_cross_entropy_backward", p2.shape, probs.dtype)
        self.scatter_entries(self.ones(len(p2), probs.dtype), self.arange(len(p2) + 1), labels, False, diff)
        self.axpby(1.0, p2, -1.0, diff)
        self._spread_rows(self._row_factor(1.0, dcost, w), diff, dx.reshape(p2.shape), beta)

    def square_error(self, x, t, w, cost):
        """cost[i] = w[i] sum_j (x - t)^2."""
        d = self._difference(x, t)
        self.multiply(d, d, d)
        self._row_sums(d, cost)
        self._weigh_rows(1.0, cost, w, cost)

    def square_error_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        """d/dx = 2 dcost w (x - t); d/dt = -d/dx (with beta)."""
        d = self._difference(x, t)
        factor = self._row_factor(-2.0 if wrt_target else 2.0, dcost, w)
        self._spread_rows(factor, d, dout.reshape(d.shape), beta)

    def bce_with_logits(self, x, t, w, cost):
        """cost[i] = w[i] sum_j max(x,0) - x t + log(1 + exp(-|x|)) (softrelu(x) - x t)."""
        x2, t2 = x.reshape(x.shape[0], -1), t.reshape(x.shape[0], -1)
        per = self.scratch("bce_with_logits", x2.shape, x.dtype)
        self.activation("softrelu", x2, per)
        xt = self.scratch("bce_with_logits xt", x2.shape, x.dtype)
        self.multiply(x2, t2, xt)
        self.axpby(-1.0, xt, 1.0, per)
        self._row_sums(per, cost)
        self._weigh_rows(1.0, cost, w, cost)

    def bce_with_logits_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        """d/dx = dcost w (sigmoid(x) - t); d/dt = -dcost w x (with beta)."""
        x2, t2 = x.reshape(x.shape[0], -1), t.reshape(x.shape[0], -1)
        if wrt_target:
            self._spread_rows(self._row_factor(-1.0, dcost, w), x2, dout.reshape(x2.shape), beta)
            return
        d = self.scratch("bce_with_logits_backward", x2.shape, x.dtype)
        self.activation("sigmoid", x2, d)
        self.axpby(-1.0, t2, 1.0, d)
        self._spread_rows(self._row_factor(1.0, dcost, w), d, dout.reshape(x2.shape), beta)

    # -- the pieces composed operations share
    def scratch(self, name: object, shape: tuple, dtype: Any) -> Any:
        """A temporary array of `shape` for a composed operation: a view of this thread's buffer
        `name`, grown (never shrunk) to the largest size asked for. Its values are garbage."""
        buffers = self.__dict__.get("_scratch")
        if buffers is None:
            buffers = self.__dict__.setdefault("_scratch", threading.local())
        size, dtype = int(math.prod(shape)), np.dtype(dtype)
        held = buffers.__dict__.get((name, dtype))
        if held is None or held.shape[0] < size:
            held = buffers.__dict__[(name, dtype)] = self.empty((max(size, 1),), dtype)
        return held[:size].reshape(shape)

    def _prefix(self, key: tuple, n: int, build: Callable[[int], np.ndarray]) -> Any:
        """The first n values of a constant array (build(size) makes its host values), kept on
        the device and grown (at least doubled) when a longer prefix is asked for: one array per
        key, whatever the lengths asked."""
        kept = self.__dict__.setdefault("_constants", {})
        held = kept.get(key)
        if held is None or held.shape[0] < n:
            held = kept[key] = self.from_host(build(max(n, 2 * (held.shape[0] if held is not None else 0), 16)))
        return held[:n]

    def arange(self, n: int) -> Any:
        """0, 1, .., n - 1 (int32) as this backend's array: the row index of every row."""
        return self._prefix(("arange",), n, lambda size: np.arange(size, dtype=np.int32))

    def ones(self, n: int, dtype: Any) -> Any:
        return self._prefix(("ones", np.dtype(dtype)), n, lambda size: np.ones(size, dtype))

    def _row_sums(self, x2, out):
        """out[i] = Σ_j x2[i, j]: a GEMM with a column of ones."""
        self.gemm(x2, self.ones(x2.shape[1], x2.dtype).reshape(x2.shape[1], 1), out.reshape(len(out), 1))

    def _spread_rows(self, factor, x2, out, beta):
        """out[i, j] = factor[i] x2[i, j] (with beta): factor spread over the columns by a GEMM
        with a row of ones, then multiplied in."""
        spread = self.scratch("spread rows", x2.shape, x2.dtype)
        self.gemm(factor.reshape(len(factor), 1), self.ones(x2.shape[1], x2.dtype).reshape(1, x2.shape[1]), spread)
        self.multiply(spread, x2, out, beta)

    def _row_factor(self, alpha, dcost, w):
        """alpha dcost[i] w[i] (w None: 1), in a scratch buffer."""
        factor = self.scratch("row factor", dcost.shape, dcost.dtype)
        self._weigh_rows(alpha, dcost, w, factor)
        return factor

    def _weigh_rows(self, alpha, cost, w, out):
        """out = alpha cost w (w None: 1); out may be cost itself."""
        self.axpby(alpha, cost, 0.0, out)
        if w is not None:
            self.multiply(out, w, out)

    def _difference(self, x, t):
        """x - t as [rows, features], in a scratch buffer."""
        x2 = x.reshape(x.shape[0], -1)
        d = self.scratch("difference", x2.shape, x.dtype)
        self.axpby(1.0, x2, 0.0, d)
        self.axpby(-1.0, t.reshape(x2.shape), 1.0, d)
        return d

    @contextmanager
    def _rows_of(self, rows: Any, **arrays: Any) -> Iterator[dict]:
        """A scratch copy of arrays[name][rows] for each name; after the block, every array but
        the gradient 'g' gets its rows back (not when the block raised)."""
        parts = {}
        for name, a in arrays.items():
            parts[name] = self.scratch(("rows of", name), (len(rows),) + tuple(a.shape[1:]), a.dtype)
            self.gather_rows(a, rows, parts[name])
        yield parts
        for name, a in arrays.items():
            if name != "g":
                self.scatter_rows(parts[name], rows, a)

    # -- optimizer updates, fused, in place on the parameter and its state
    @abstractmethod
    def sgd_update(self, p, g, v, lr, momentum, dampening, nesterov, weight_decay): ...

    @abstractmethod
    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step): ...

    @abstractmethod
    def adagrad_update(self, p, g, s, lr, eps, weight_decay): ...

    @abstractmethod
    def rmsprop_update(self, p, g, s, buf, lr, alpha, eps, weight_decay, momentum): ...


class HostStatistics:
    """Batch-norm statistics as float64 numpy vectors of C values on the host: the CPU and
    reference backends share these three methods (the OpenCL backend keeps them on the device)."""

    def stat_dtype(self, dtype):
        return np.dtype(np.float64)

    def batch_norm_statistics(self, mean, var, invstd, running_mean, running_var, eps, momentum, count, training):
        if training:
            np.divide(1.0, np.sqrt(var + eps), out=invstd)
            for run, value, scale in ((running_mean, mean, 1.0), (running_var, var, count / max(count - 1, 1))):
                run *= 1 - momentum
                run += momentum * scale * value
        else:
            mean[...] = running_mean
            np.divide(1.0, np.sqrt(running_var + eps), out=invstd)

    def add_cast(self, src, dst, beta=0.0):
        dst[...] = src if beta == 0 else src + beta * dst


class Snapshot:
    """The composed pack (Backend.pack): a copy of b, and alpha and trans to multiply it with;
    for int8 products b's integers and the scales of its rows."""

    def __init__(self, b: Any, trans: bool, alpha: float, precision: str = "float32", scales: Any = None) -> None:
        self.b, self.trans, self.alpha, self.dtype, self.precision = b, trans, alpha, b.dtype, precision
        self.scales = scales
        self.max_rows = sys.maxsize  # (a product of any number of rows computes from it)
        self.k, self.n = (b.shape[1], b.shape[0]) if trans else b.shape


# the kernels every backend implements; everything else in Backend is composed from them
CORE_KERNELS = frozenset(Backend.__abstractmethods__)


def window_parts(window):
    """(kernel, stride, padding, dilation) of a pooling window: 3-tuples over D, H, W, the
    dilation (the step between a window's taps) 1 where the window does not give one."""
    kernel, stride, padding, *rest = window
    return kernel, stride, padding, (rest[0] if rest else (1, 1, 1))
