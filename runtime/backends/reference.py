"""A plain numpy implementation of the kernel interface: slow, obvious, and the yardstick that the
conformance test holds every real backend to (ncnn keeps such a reference beside its fast ops).

Written from the math in base.py's docstrings, independently of the compiled kernels.
"""
import math

import numpy as np

from .base import Backend, HostStatistics, Snapshot, check_activation, window_parts
from ..precision import check_precision, quantize_rows, round_bfloat16
from .checks import select_on_host
from .checks import (check_attention, check_by_column, check_index, check_layer_norm, check_offsets, check_positions,
                     check_selection)


SELU_ALPHA, SELU_SCALE = 1.6732632423543772, 1.0507009873554805
_erf = np.vectorize(math.erf, otypes=[np.float64])


def _with_beta(out, value, beta):
    out[...] = value if beta == 0 else value + beta * out


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def _act(kind, x, slope):
    return {
        "linear": lambda: x,
        "sigmoid": lambda: _sigmoid(x),
        "tanh": lambda: np.tanh(x),
        "relu": lambda: np.maximum(x, 0),
        "leaky_relu": lambda: np.where(x > 0, x, slope * x),
        "exponential": lambda: np.exp(x),
        "softrelu": lambda: np.log1p(np.exp(x)),
        "softmax": lambda: np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True),
        "log_softmax": lambda: x - x.max(-1, keepdims=True) - np.log(np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)),
        "elu": lambda: np.where(x < 0, slope * np.expm1(x), x),
        "selu": lambda: SELU_SCALE * np.where(x < 0, SELU_ALPHA * np.expm1(x), x),
        "softsign": lambda: x / (1 + np.abs(x)),
        "hard_sigmoid": lambda: np.clip(slope * x + 0.5, 0, 1),
        "gelu": lambda: 0.5 * x * (1 + _erf(x / np.sqrt(2))),
        "hard_swish": lambda: x * np.clip(x / 6 + 0.5, 0, 1),
        "gelu_tanh": lambda: 0.5 * x * (1 + np.tanh(GELU_TANH_C * (x + 0.044715 * x ** 3))),
        "bounded_relu": lambda: np.where(x > slope, slope, np.maximum(x, 0)),
        "sqrt": lambda: np.sqrt(x),
        "reciprocal": lambda: 1 / x,
        "log": lambda: np.log(x),
        "abs": lambda: np.abs(x),
        "erf": lambda: _erf(x),
    }[kind]()


def _act_grad(kind, y, dy, slope):
    return {
        "linear": lambda: dy,
        "sigmoid": lambda: dy * y * (1 - y),
        "tanh": lambda: dy * (1 - y * y),
        "relu": lambda: dy * (y > 0),
        "leaky_relu": lambda: dy * np.where(y > 0, 1, slope),
        "exponential": lambda: dy * y,
        "softrelu": lambda: dy * (1 - np.exp(-y)),
        "softmax": lambda: y * (dy - (dy * y).sum(-1, keepdims=True)),
        "log_softmax": lambda: dy - np.exp(y) * dy.sum(-1, keepdims=True),
        "elu": lambda: dy * np.where(y > 0, 1, y + slope),
        "selu": lambda: dy * np.where(y > 0, SELU_SCALE, y + SELU_SCALE * SELU_ALPHA),
        "softsign": lambda: dy * (1 - np.abs(y)) ** 2,
        "hard_sigmoid": lambda: dy * np.where((y > 0) & (y < 1), slope, 0),
        "bounded_relu": lambda: dy * ((y > 0) & (y < slope)),
        # y is the input x for these (INPUT_GRAD_ACTIVATIONS)
        "gelu": lambda: dy * (0.5 * (1 + _erf(y / np.sqrt(2))) + y * np.exp(-0.5 * y * y) / np.sqrt(2 * np.pi)),
        "hard_swish": lambda: dy * np.where(y < -3, 0, np.where(y > 3, 1, y / 3 + 0.5)),
        "gelu_tanh": lambda: dy * _gelu_tanh_grad(y),
        "sqrt": lambda: dy * 0.5 / y,
        "reciprocal": lambda: -dy * y * y,
        "log": lambda: dy / y,
        "abs": lambda: dy * np.sign(y),
        "erf": lambda: dy * (2 / np.sqrt(np.pi)) * np.exp(-y * y),
    }[kind]()


GELU_TANH_C = np.sqrt(2 / np.pi)


def _gelu_tanh_grad(x):
    t = np.tanh(GELU_TANH_C * (x + 0.044715 * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * GELU_TANH_C * (1 + 3 * 0.044715 * x * x)


def _w(w, rows, dtype):
    return np.ones(rows, dtype) if w is None else w


class ReferenceBackend(HostStatistics, Backend):
    name = "reference"
    host_arrays = True

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def fill(self, a, value):
        a.fill(value)

    def from_host(self, array):
        return np.array(array)

    def to_host(self, a):
        return a

    def copy(self, src, dst):
        dst[...] = src

    def gemm(self, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        _with_beta(c, alpha * ((a.T if trans_a else a) @ (b.T if trans_b else b)), beta)

    def pack(self, b, trans=False, alpha=1.0, max_rows=1, precision="float32"):
        if check_precision(precision, "pack") != "float32":  # (Backend's composed form)
            return super().pack(b, trans, alpha, max_rows, precision)
        return alpha * (b.T if trans else b).copy()

    def packed_gemm(self, a, packed, c, beta=0.0):
        if isinstance(packed, Snapshot):
            return super().packed_gemm(a, packed, c, beta)
        _with_beta(c, a @ packed, beta)

    def round_to_bfloat16(self, x, y):
        if x.dtype != np.float32:
            raise TypeError(f"round_to_bfloat16: x must be float32, found {x.dtype}")
        y[...] = round_bfloat16(x)

    def quantize_rows(self, x, q, scales, levels, symmetric=False):
        if x.dtype != np.float32 or x.ndim != 2:
            raise TypeError(f"quantize_rows: x must be 2-D float32, found {x.dtype} of shape {x.shape}")
        q[...], scales[...] = quantize_rows(x, levels, symmetric)

    def add_bias(self, y, b):
        y += b

    def bias_grad(self, dy, db, beta=0.0):
        _with_beta(db, dy.reshape(dy.shape[0], -1).sum(0), beta)

    def activation(self, kind, x, y, slope=0.01):
        y[...] = _act(check_activation(kind, "activation"), x.astype(np.float64), slope)

    def activation_backward(self, kind, y, dy, dx, beta=0.0, slope=0.01):
        _with_beta(dx, _act_grad(check_activation(kind, "activation"), y.astype(np.float64), dy, slope), beta)

    def axpby(self, alpha, x, beta, y):
        _with_beta(y, alpha * x, beta)

    def multiply(self, a, b, out, beta=0.0):
        _with_beta(out, a * b, beta)

    def select(self, cond, a, b, out):
        select_on_host(cond, a, b, out)

    def sum_squares(self, x, rows=None):
        if rows is not None:
            check_index("sum_squares", "rows", rows, x.shape[0])
            x = x[rows]
        return float((x.astype(np.float64) ** 2).sum())

    def copy_to_columns(self, src, dst, col, beta=0.0):
        _with_beta(dst[:, col:col + src.shape[1]], src, beta)

    def copy_from_columns(self, src, col, dst, beta=0.0):
        _with_beta(dst, src[:, col:col + dst.shape[1]], beta)

    def gather_rows(self, src, index, dst, col=0):
        check_index("gather_rows", "index", index, src.shape[0])
        src2 = src.reshape(src.shape[0], -1)
        dst[...] = src2[index, col:col + dst.reshape(dst.shape[0], -1).shape[1]].reshape(dst.shape)

    def scatter_rows(self, src, index, dst, beta=0.0, col=0):
        check_index("scatter_rows", "index", index, dst.shape[0])
        src2, dst2 = src.reshape(src.shape[0], -1), dst.reshape(dst.shape[0], -1)
        block = dst2[index, col:col + src2.shape[1]]
        dst2[index, col:col + src2.shape[1]] = src2 if beta == 0 else src2 + beta * block

    def scatter_add_rows(self, src, ids, dst):
        check_index("scatter_add_rows", "ids", ids, dst.shape[0])
        np.add.at(dst, ids, src)

    def fill_rows(self, dst, rows, value):
        check_index("fill_rows", "rows", rows, dst.shape[0])
        dst[rows] = value

    def sgd_update_rows(self, p, g, v, rows, lr, momentum=0.0, dampening=0.0, nesterov=False):
        check_index("sgd_update_rows", "rows", rows, p.shape[0])
        step = g[rows]
        if momentum:
            v[rows] = momentum * v[rows] + (1 - dampening) * step
            step = step + momentum * v[rows] if nesterov else v[rows]
        p[rows] -= lr * step

    def adam_update_rows(self, p, g, m, v, rows, lr, beta1, beta2, eps, step):
        check_index("adam_update_rows", "rows", rows, p.shape[0])
        m[rows] = beta1 * m[rows] + (1 - beta1) * g[rows]
        v[rows] = beta2 * v[rows] + (1 - beta2) * g[rows] ** 2
        m_hat, v_hat = m[rows] / (1 - beta1 ** step), v[rows] / (1 - beta2 ** step)
        p[rows] -= lr * m_hat / (np.sqrt(v_hat) + eps)

    def adagrad_update_rows(self, p, g, s, rows, lr, eps):
        check_index("adagrad_update_rows", "rows", rows, p.shape[0])
        s[rows] += g[rows] ** 2
        p[rows] -= lr * g[rows] / (np.sqrt(s[rows]) + eps)

    def sequence_pool(self, mode, x, starts, out, argmax):
        check_offsets("sequence_pool", "starts", starts, len(x))
        for s in range(len(starts) - 1):
            seq = x[starts[s]:starts[s + 1]]
            out[s] = {"last": lambda: seq[-1], "first": lambda: seq[0], "average": lambda: seq.mean(0),
                      "sum": lambda: seq.sum(0), "max": lambda: seq.max(0)}[mode]()
            if mode == "max":
                argmax[s] = starts[s] + seq.argmax(0)

    def sequence_pool_backward(self, mode, dy, starts, argmax, dx, beta=0.0):
        check_offsets("sequence_pool_backward", "starts", starts, len(dx))
        grad = np.zeros_like(dx)
        for s in range(len(starts) - 1):
            a, b = starts[s], starts[s + 1]
            if mode == "last":
                grad[b - 1] = dy[s]
            elif mode == "first":
                grad[a] = dy[s]
            elif mode == "max":
                for j in range(dy.shape[1]):
                    grad[argmax[s, j], j] = dy[s, j]
            else:
                grad[a:b] = dy[s] / (b - a if mode == "average" else 1)
        _with_beta(dx, grad, beta)

    def sequence_softmax(self, x, starts, y):
        check_offsets("sequence_softmax", "starts", starts, x.size)
        for s in range(len(starts) - 1):
            seq = x[starts[s]:starts[s + 1]].astype(np.float64)
            e = np.exp(seq - seq.max())
            y[starts[s]:starts[s + 1]] = e / e.sum()

    def sequence_softmax_backward(self, y, dy, starts, dx, beta=0.0):
        check_offsets("sequence_softmax_backward", "starts", starts, y.size)
        grad = np.empty_like(dx)
        for s in range(len(starts) - 1):
            sl = slice(starts[s], starts[s + 1])
            grad[sl] = y[sl] * (dy[sl] - (dy[sl] * y[sl]).sum())
        _with_beta(dx, grad, beta)

    # -- attention and layer normalization
    @staticmethod
    def _heads(qkv, starts, heads, causal):
        """Per (sequence slice, head): the query, key and value blocks (float64) and the mask of
        the keys each query may see."""
        E = qkv.shape[1] // 3
        d = E // heads
        for s in range(len(starts) - 1):
            rows = slice(starts[s], starts[s + 1])
            n = rows.stop - rows.start
            seen = np.tril(np.ones((n, n), bool)) if causal else np.ones((n, n), bool)
            for h in range(heads):
                q, k, v = (qkv[rows, part * E + h * d:part * E + (h + 1) * d].astype(np.float64) for part in range(3))
                yield rows, slice(h * d, (h + 1) * d), h, q, k, v, seen

    def attention(self, qkv, starts, heads, scale, causal, out, lse):
        check_attention("attention", qkv, starts, heads, out, lse)
        for rows, cols, h, q, k, v, seen in self._heads(qkv, starts, heads, causal):
            s = np.where(seen, scale * (q @ k.T), -np.inf)
            top = s.max(axis=1, keepdims=True)
            total = np.exp(s - top).sum(axis=1, keepdims=True)
            out[rows, cols] = (np.exp(s - top) / total) @ v
            lse[rows, h] = (top + np.log(total))[:, 0]

    def attention_backward(self, qkv, out, lse, dout, starts, heads, scale, causal, dqkv):
        check_attention("attention_backward", qkv, starts, heads, out, lse, dout=dout, dqkv=dqkv)
        E = out.shape[1]
        for rows, cols, h, q, k, v, seen in self._heads(qkv, starts, heads, causal):
            p = np.where(seen, np.exp(scale * (q @ k.T) - lse[rows, h, None]), 0.0)
            g = dout[rows, cols].astype(np.float64)
            ds = p * (g @ v.T - (g * out[rows, cols]).sum(axis=1, keepdims=True))
            for part, grad in enumerate((scale * ds @ k, scale * ds.T @ q, p.T @ g)):
                dqkv[rows, part * E + cols.start:part * E + cols.stop] = grad

    def layer_norm(self, x, gamma, beta, eps, y, mean, rstd, center=True):
        check_layer_norm("layer_norm", x, mean, rstd, {"gamma": gamma, "beta": beta}, {"y": y})
        x64 = x.astype(np.float64)
        mu = x64.mean(axis=1) if center else np.zeros(len(x))
        r = 1 / np.sqrt(((x64 - mu[:, None]) ** 2).mean(axis=1) + eps)
        y[...] = (x64 - mu[:, None]) * r[:, None] * (1 if gamma is None else gamma) + (0 if beta is None else beta)
        mean[...], rstd[...] = mu, r

    def layer_norm_backward(self, x, dy, mean, rstd, gamma, dx=None, dx_beta=0.0, dgamma=None, dgamma_beta=0.0,
                            dbeta=None, dbeta_beta=0.0, center=True):
        check_layer_norm("layer_norm_backward", x, mean, rstd, {"gamma": gamma, "dgamma": dgamma, "dbeta": dbeta},
                         {"dy": dy, "dx": dx})
        xhat = (x.astype(np.float64) - mean[:, None]) * rstd[:, None]
        g = dy * (1 if gamma is None else gamma)
        if dx is not None:
            centred = g - g.mean(axis=1, keepdims=True) if center else g
            _with_beta(dx, rstd[:, None] * (centred - xhat * (g * xhat).mean(axis=1, keepdims=True)), dx_beta)
        if dgamma is not None:
            _with_beta(dgamma, (dy * xhat).sum(axis=0), dgamma_beta)
        if dbeta is not None:
            _with_beta(dbeta, dy.sum(axis=0, dtype=np.float64), dbeta_beta)

    # -- selections
    @staticmethod
    def _entries(where, starts, cols, shared, entries, shape):
        """(row, column) of every entry, checked against `entries` values of a [rows, columns] array."""
        check_selection(where, starts, cols, shared, entries, *shape)
        rows = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        if shared:
            cols = np.tile(cols, len(starts) - 1)
        return rows, cols

    def selected_dots(self, x, w, by_column, out, beta=0.0):
        check_by_column("selected_dots", by_column, len(out), x.shape[0], w.shape[0])
        columns, bucket, entries, entry_rows = by_column
        cols = np.repeat(columns, np.diff(bucket))
        value = np.empty(len(out))
        value[entries] = np.einsum("ej,ej->e", x[entry_rows].astype(np.float64), w[cols])
        _with_beta(out, value, beta)

    def selected_backward(self, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        check_by_column("selected_backward", by_column, len(g), x.shape[0], w.shape[0])
        columns, bucket, entries, entry_rows = by_column
        cols = np.repeat(columns, np.diff(bucket))
        ge = g[entries].astype(np.float64)[:, None]
        if dx is not None:
            grad = np.zeros(dx.shape)
            np.add.at(grad, entry_rows, ge * w[cols])
            _with_beta(dx, grad, dx_beta)
        if dw is not None:
            grad = np.zeros((len(columns), dw.shape[1]))
            np.add.at(grad, np.repeat(np.arange(len(columns)), np.diff(bucket)), ge * x[entry_rows])
            dw[columns] = grad if dw_beta == 0 else grad + dw_beta * dw[columns]

    def selected_bias_grad(self, g, by_column, db, beta=0.0):
        check_by_column("selected_bias_grad", by_column, len(g), len(g), db.shape[0])
        columns, bucket, entries, _ = by_column
        for u, c in enumerate(columns):
            db[c] = g[entries[bucket[u]:bucket[u + 1]]].sum() + (beta * db[c] if beta else 0)

    def add_selected_bias(self, out, b, cols):
        check_index("add_selected_bias", "cols", cols, b.shape[0])
        out += b[cols]

    def gather_entries(self, full, starts, cols, shared, out, beta=0.0):
        rows, cols = self._entries("gather_entries", starts, cols, shared, len(out), full.shape)
        _with_beta(out, full[rows, cols], beta)

    def scatter_entries(self, g, starts, cols, shared, full):
        rows, cols = self._entries("scatter_entries", starts, cols, shared, len(g), full.shape)
        full[...] = 0
        np.add.at(full, (rows, cols), g)

    @staticmethod
    def _segments(starts, pos=None, entries=None, where="segment"):
        if pos is not None:
            check_offsets(where, "starts", starts, entries)
            check_positions(where, "pos", pos, starts)
        return [slice(starts[i], starts[i + 1]) for i in range(len(starts) - 1)]

    def segment_cross_entropy(self, z, starts, pos, shift, w, probs, cost):
        s = z.astype(np.float64) - (0 if shift is None else shift)
        for i, sl in enumerate(self._segments(starts, pos, len(z), "segment_cross_entropy")):
            m = s[sl].max()
            lse = m + np.log(np.exp(s[sl] - m).sum())
            probs[sl] = np.exp(s[sl] - lse)
            cost[i] = _w(w, len(cost), np.float64)[i] * (lse - s[pos[i]])

    def segment_cross_entropy_backward(self, probs, starts, pos, w, dcost, dz, beta=0.0):
        self._segments(starts, pos, len(probs), "segment_cross_entropy_backward")
        grad = probs.astype(np.float64).copy()
        grad[pos] -= 1
        row = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        _with_beta(dz, grad * (dcost * _w(w, len(dcost), np.float64))[row], beta)

    def segment_self_normalized(self, o, starts, pos, alpha, w, cost):
        for i, sl in enumerate(self._segments(starts, pos, len(o), "segment_self_normalized")):
            ls = np.log(o[sl].astype(np.float64).sum())
            cost[i] = _w(w, len(cost), np.float64)[i] * (-np.log(o[pos[i]]) + ls + alpha * ls * ls)

    def segment_self_normalized_backward(self, o, starts, pos, alpha, w, dcost, do, beta=0.0):
        grad = np.empty(len(o))
        for i, sl in enumerate(self._segments(starts, pos, len(o), "segment_self_normalized_backward")):
            total = o[sl].astype(np.float64).sum()
            grad[sl] = (1 + 2 * alpha * np.log(total)) / total
        grad[pos] -= 1 / o[pos].astype(np.float64)
        row = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
        _with_beta(do, grad * (dcost * _w(w, len(dcost), np.float64))[row], beta)

    @staticmethod
    def _windows(x, geometry, rows=None):
        """Yield (row, column, source index or None) for every entry of the column matrix."""
        kernel, stride, padding, dilation, grid = geometry
        C, D, H, W = x.shape
        r0, r1 = rows if rows is not None else (0, grid[0] * grid[1])
        import itertools
        for c, a, b, e in itertools.product(range(C), *(range(k) for k in kernel)):
            row = ((c * kernel[0] + a) * kernel[1] + b) * kernel[2] + e
            positions = [(r // grid[1], r % grid[1], ow) for r in range(r0, r1) for ow in range(grid[2])]
            for col, (od, oh, ow) in enumerate(positions):
                idx = [o * s - p + k * d for o, s, p, k, d in zip((od, oh, ow), stride, padding, (a, b, e), dilation)]
                inside = all(0 <= i < n for i, n in zip(idx, (D, H, W)))
                yield row, col, ((c, *idx) if inside else None)

    def resample_axis(self, x, taps, weights, y):
        check_index("resample_axis", "taps", taps, x.shape[1])
        y[...] = sum(weights[:, k][None, :, None] * x[:, taps[:, k], :] for k in range(taps.shape[1]))

    def resample_axis_backward(self, dy, taps, weights, dx, beta=0.0):
        check_index("resample_axis_backward", "taps", taps, dx.shape[1])
        grad = np.zeros_like(dx)
        for k in range(taps.shape[1]):
            np.add.at(grad, (slice(None), taps[:, k]), weights[:, k][None, :, None] * dy)
        dx[...] = grad + beta * dx if beta else grad

    def vol2col(self, x, col, geometry, rows=None):
        for row, j, src in self._windows(x, geometry, rows):
            col[row, j] = x[src] if src is not None else 0

    def col2vol(self, col, x, geometry, rows=None):
        for row, j, dst in self._windows(x, geometry, rows):
            if dst is not None:
                x[dst] += col[row, j]

    def channel_bias(self, y, b, beta=1.0):
        _with_beta(y, np.broadcast_to(b.reshape((1, -1) + (1,) * (y.ndim - 2)), y.shape), beta)

    def channel_bias_grad(self, dy, db, beta=0.0):
        _with_beta(db, dy.sum(axis=tuple(i for i in range(dy.ndim) if i != 1)), beta)

    @staticmethod
    def _pool_windows(x_shape, out_shape, window):
        import itertools
        kernel, stride, padding, dilation = window_parts(window)
        spatial = (1,) * (5 - len(x_shape)) + tuple(x_shape[2:])
        grid = (1,) * (5 - len(out_shape)) + tuple(out_shape[2:])
        for pos in itertools.product(*(range(g) for g in grid)):
            cells = [idx for idx in itertools.product(*(range(o * s - p, o * s - p + (k - 1) * d + 1, d) for o, s, p, k, d
                                                         in zip(pos, stride, padding, kernel, dilation)))
                     if all(0 <= i < n for i, n in zip(idx, spatial))]
            yield pos, cells, int(math.prod(kernel))

    def max_pool(self, x, out, argmax, window):
        x5 = x.reshape(x.shape[:2] + (1,) * (5 - x.ndim) + x.shape[2:])
        out5 = out.reshape(out.shape[:2] + (1,) * (5 - out.ndim) + out.shape[2:])
        spatial = x5.shape[2:]
        planes = x5.reshape(-1, *spatial)
        for j, (pos, cells, _) in enumerate(self._pool_windows(x.shape, out.shape, window)):
            vals = np.stack([planes[(slice(None),) + c] for c in cells], 1)
            best = vals.argmax(1)
            out5.reshape(-1, *out5.shape[2:])[(slice(None),) + pos] = vals[np.arange(len(vals)), best]
            if argmax is not None:
                argmax[:, j] = [np.ravel_multi_index(cells[b], spatial) for b in best]

    def max_pool_backward(self, dy, argmax, dx, beta=0.0, window=None):
        check_index("max_pool_backward", "argmax", argmax, int(math.prod(dx.shape[2:])))
        grad = np.zeros((dx.shape[0] * dx.shape[1], int(math.prod(dx.shape[2:]))))
        flat_dy = dy.reshape(grad.shape[0], -1)
        for q in range(grad.shape[0]):
            np.add.at(grad[q], argmax[q], flat_dy[q])
        _with_beta(dx, grad.reshape(dx.shape), beta)

    def avg_pool(self, x, out, window, count_include_pad=True):
        x5 = x.reshape(x.shape[:2] + (1,) * (5 - x.ndim) + x.shape[2:])
        planes = x5.reshape(-1, *x5.shape[2:])
        out_planes = out.reshape(planes.shape[0], *((1,) * (5 - out.ndim) + out.shape[2:]))
        for pos, cells, size in self._pool_windows(x.shape, out.shape, window):
            total = sum(planes[(slice(None),) + c] for c in cells)
            out_planes[(slice(None),) + pos] = total / (size if count_include_pad else len(cells))

    def avg_pool_backward(self, dy, dx, window, count_include_pad=True, beta=0.0):
        grad = np.zeros((dx.shape[0] * dx.shape[1],) + (1,) * (5 - dx.ndim) + dx.shape[2:])
        dy_planes = dy.reshape(grad.shape[0], *((1,) * (5 - dy.ndim) + dy.shape[2:]))
        for pos, cells, size in self._pool_windows(dx.shape, dy.shape, window):
            share = dy_planes[(slice(None),) + pos] / (size if count_include_pad else len(cells))
            for c in cells:
                grad[(slice(None),) + c] += share
        _with_beta(dx, grad.reshape(dx.shape), beta)

    def batch_norm_stats(self, x, mean, var):
        axes = tuple(i for i in range(x.ndim) if i != 1)
        x64 = x.astype(np.float64)
        mean[...] = x64.mean(axes)
        var[...] = x64.var(axes)

    def batch_norm_apply(self, x, mean, invstd, gamma, beta, y, activation=None):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        xhat = (x - mean.reshape(shape)) * invstd.reshape(shape)
        y[...] = xhat * gamma.reshape(shape) + beta.reshape(shape) if gamma is not None else xhat
        self.activate_in_place(activation, y)

    def batch_norm_backward(self, x, dy, mean, invstd, gamma, batch_stats, dx, beta, dgamma, dbeta):
        shape = (1, -1) + (1,) * (x.ndim - 2)
        axes = tuple(i for i in range(x.ndim) if i != 1)
        xhat = (x - mean.reshape(shape)) * invstd.reshape(shape)
        dgamma[...] = (dy * xhat).sum(axes)
        dbeta[...] = dy.sum(axes)
        if dx is None:
            return
        g = invstd.reshape(shape) * (gamma.reshape(shape) if gamma is not None else 1)
        m = x.size / x.shape[1]
        grad = g * (dy - dbeta.reshape(shape) / m - xhat * dgamma.reshape(shape) / m) if batch_stats else g * dy
        _with_beta(dx, grad, beta)

    def lstm_step(self, g, c_prev, c, h):
        H = h.shape[1]
        i, f, o = (_sigmoid(g[:, k * H:(k + 1) * H]) for k in (0, 1, 3))
        gg = np.tanh(g[:, 2 * H:3 * H])
        g[...] = np.concatenate([i, f, gg, o], 1)
        c[...] = i * gg + (0 if c_prev is None else f * c_prev)
        h[...] = o * np.tanh(c)

    def lstm_step_backward(self, g, c_prev, c, dh, dc, dg, dc_prev):
        H = dh.shape[1]
        i, f, gg, o = (g[:, k * H:(k + 1) * H] for k in range(4))
        tc = np.tanh(c)
        dct = dc + dh * o * (1 - tc ** 2)
        cp = 0 if c_prev is None else c_prev
        dg[...] = np.concatenate([dct * gg * i * (1 - i), dct * cp * f * (1 - f),
                                  dct * i * (1 - gg ** 2), dh * tc * o * (1 - o)], 1)
        if dc_prev is not None:
            dc_prev += dct * f

    def gru_step(self, g, hh, h_prev, h):
        H = h.shape[1]
        r = _sigmoid(g[:, :H] + hh[:, :H])
        z = _sigmoid(g[:, H:2 * H] + hh[:, H:2 * H])
        n = np.tanh(g[:, 2 * H:] + r * hh[:, 2 * H:])
        g[...] = np.concatenate([r, z, n], 1)
        h[...] = (1 - z) * n + z * (0 if h_prev is None else h_prev)

    def gru_step_backward(self, g, hh, h_prev, dh, dgx, dgh, dh_prev):
        H = dh.shape[1]
        r, z, n = (g[:, k * H:(k + 1) * H] for k in range(3))
        hp = 0 if h_prev is None else h_prev
        dn = dh * (1 - z) * (1 - n ** 2)
        dz = dh * (hp - n) * z * (1 - z)
        dr = dn * hh[:, 2 * H:] * r * (1 - r)
        dgx[...] = np.concatenate([dr, dz, dn], 1)
        dgh[...] = np.concatenate([dr, dz, dn * r], 1)
        if dh_prev is not None:
            dh_prev += dh * z

    def bernoulli_mask(self, mask, keep, rng):
        mask[...] = (rng.random(mask.shape) < keep) / keep

    def softmax_cross_entropy(self, x, labels, w, probs, cost):
        x2 = x.reshape(x.shape[0], -1).astype(np.float64)
        check_index("softmax_cross_entropy", "labels", labels, x2.shape[1])
        p = _act("softmax", x2, 0)
        if probs is not None:
            probs[...] = p.reshape(probs.shape)
        cost[...] = -_w(w, len(x2), np.float64) * np.log(p[np.arange(len(x2)), labels])

    def softmax_cross_entropy_backward(self, probs, labels, w, dcost, dx, beta=0.0):
        p2 = probs.reshape(probs.shape[0], -1)
        check_index("softmax_cross_entropy_backward", "labels", labels, p2.shape[1])
        onehot = np.zeros_like(p2)
        onehot[np.arange(len(p2)), labels] = 1
        g = (dcost * _w(w, len(p2), dcost.dtype))[:, None]
        _with_beta(dx, (g * (p2 - onehot)).reshape(dx.shape), beta)

    def _row_weights(self, x, w, dcost=None):
        g = _w(w, x.shape[0], x.dtype) * (1 if dcost is None else dcost)
        return g.reshape((-1,) + (1,) * (x.ndim - 1))

    def square_error(self, x, t, w, cost):
        d = (x - t).reshape(x.shape[0], -1)
        cost[...] = _w(w, x.shape[0], x.dtype) * (d * d).sum(1)

    def square_error_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        g = 2 * self._row_weights(x, w, dcost) * (x - t)
        _with_beta(dout, -g if wrt_target else g, beta)

    def bce_with_logits(self, x, t, w, cost):
        x64 = x.astype(np.float64)
        per = np.log1p(np.exp(x64)) - x64 * t  # log(1 + e^x) - x t, the plain form
        cost[...] = _w(w, x.shape[0], x.dtype) * per.reshape(x.shape[0], -1).sum(1)

    def bce_with_logits_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        g = self._row_weights(x, w, dcost)
        _with_beta(dout, -g * x if wrt_target else g * (_sigmoid(x.astype(np.float64)) - t), beta)

    def sgd_update(self, p, g, v, lr, momentum, dampening, nesterov, weight_decay):
        g = g + weight_decay * p
        if momentum:
            v[...] = momentum * v + (1 - dampening) * g
            g = g + momentum * v if nesterov else v
        p -= lr * g

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        if decoupled:
            p *= 1 - lr * weight_decay
        else:
            g = g + weight_decay * p
        m[...] = beta1 * m + (1 - beta1) * g
        v[...] = beta2 * v + (1 - beta2) * g * g
        m_hat = m / (1 - beta1 ** step)
        v_hat = v / (1 - beta2 ** step)
        p -= lr * m_hat / (np.sqrt(v_hat) + eps)

    def adagrad_update(self, p, g, s, lr, eps, weight_decay):
        g = g + weight_decay * p
        s += g * g
        p -= lr * g / (np.sqrt(s) + eps)

    def rmsprop_update(self, p, g, s, buf, lr, alpha, eps, weight_decay, momentum):
        g = g + weight_decay * p
        s[...] = alpha * s + (1 - alpha) * g * g
        step = g / (np.sqrt(s) + eps)
        if momentum:
            buf[...] = momentum * buf + step
            step = buf
        p -= lr * step
