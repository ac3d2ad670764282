# cython: language_level=3
"""Kernels of the selective fully-connected layer and its costs.

A selection is CSR over the rows of a batch: row i selects the output columns
cols[starts[i]:starts[i + 1]], and each selected (row, column) is one "entry" e with a value
out[e]. Conventions as in lamina._kernels: C-contiguous arrays, "with beta" outputs
(beta == 0 never reads the output), shapes checked by the caller (lamina.backends.cpu).
"""
from cython.parallel cimport prange
from libc.math cimport exp, log
import numpy as np

ctypedef fused real:
    float
    double

cdef extern from "rows.h" nogil:
    float lamina_dot_f(const float* a, const float* b, long n)
    double lamina_dot_d(const double* a, const double* b, long n)
    void lamina_combine_rows_f(const float* rows, long ld, const int* index, const float* coef, long m, float beta,
                               float* y, long n)
    void lamina_combine_rows_d(const double* rows, long ld, const int* index, const double* coef, long m,
                               double beta, double* y, long n)
    void lamina_prefetch(const void* p, long bytes)
    void lamina_combine_rows_bf16(const unsigned short* rows, long ld, const int* index, const float* coef, long m,
                                  float beta, float* y, long n)
    float lamina_dot_bf16(const unsigned short* a, const unsigned short* b, long n, int native)
    int lamina_dot_bf16_native()

cdef extern from "convert.h" nogil:
    void lamina_to_bfloat16(const float* x, unsigned short* out, long n)

# selected rows of w are asked for this many columns ahead of their use (a selection skips
# rows, which breaks the hardware prefetcher's streams)
cdef enum:
    PREFETCH_AHEAD = 2

# below this many multiply-adds a loop runs on one thread
cdef enum:
    PARALLEL_MIN = 262144


cdef inline double _dot(real* a, real* b, long n) noexcept nogil:
    if real is float:
        return lamina_dot_f(a, b, n)
    else:
        return lamina_dot_d(a, b, n)


def selected_dots(real[:, ::1] x, real[:, ::1] w, const int[::1] columns, const int[::1] bucket,
                  const int[::1] entries, const int[::1] entry_rows, real[::1] out, double beta):
    """out[e] = x[row(e)] · w[col(e)] + beta * out[e] for every entry, walking the selected
    columns in increasing order (the CSC of by_column): each selected row of w is read once,
    and each thread streams through one contiguous range of w."""
    cdef Py_ssize_t u, k, e, n = x.shape[1], distinct = columns.shape[0]
    cdef double v
    for u in prange(distinct, nogil=True, schedule="static",
                    use_threads_if=entries.shape[0] * n > PARALLEL_MIN):
        if u + PREFETCH_AHEAD < distinct:
            lamina_prefetch(&w[columns[u + PREFETCH_AHEAD], 0], n * sizeof(real))
        for k in range(bucket[u], bucket[u + 1]):
            e = entries[k]
            v = _dot(&x[entry_rows[k], 0], &w[columns[u], 0], n)
            if beta == 0:
                out[e] = <real>v
            else:
                out[e] = <real>(v + beta * out[e])


cdef inline void _combine(real* rows, long ld, const int* index, real* coef, long m, double beta, real* y,
                         long n) noexcept nogil:
    if real is float:
        lamina_combine_rows_f(rows, ld, index, coef, m, <float>beta, y, n)
    else:
        lamina_combine_rows_d(rows, ld, index, coef, m, beta, y, n)


def selected_backward(real[::1] g, real[:, ::1] x, real[:, ::1] w, const int[::1] columns,
                      const int[::1] bucket, const int[::1] entries, const int[::1] entry_rows,
                      real[:, ::1] dx, double dx_beta, bint want_dx,
                      real[:, ::1] dw, double dw_beta, bint want_dw):
    """The gradients of the selected dots (with their betas, each where wanted):
        dx[i] = Σ_e g[e] w[col(e)] over row i's entries
        dw[c] = Σ_e g[e] x[row(e)] over column c's entries (each selected row of dw written once)
    Each output row is one combination of the rows it sums, in registers (rows.h
    lamina_combine_rows) and stored once: dw by the selected columns (the by_column order), dx
    by rows, its listing regrouped by row first (a counting sort, one pass over the entries:
    within a row its columns stay in increasing order). Threads own output rows, so none adds
    into another's."""
    cdef Py_ssize_t u, k, i, n = x.shape[1], rows = x.shape[0], distinct = columns.shape[0]
    cdef Py_ssize_t listed = entries.shape[0]
    cdef bint parallel = listed * n > PARALLEL_MIN
    cdef real* x_rows = &x[0, 0] if rows * n else NULL
    cdef real* w_rows = &w[0, 0] if w.shape[0] * n else NULL
    if n == 0:
        return
    dtype = np.float32 if real is float else np.float64
    cdef real[::1] coef = np.empty(max(listed, 1), dtype)
    cdef real[::1] row_coef
    cdef int[::1] row_cols, row_start
    for k in range(listed):
        coef[k] = g[entries[k]]
    if want_dw:
        for u in prange(distinct, nogil=True, schedule="static", use_threads_if=parallel):
            _combine(x_rows, n, &entry_rows[bucket[u]], &coef[bucket[u]], bucket[u + 1] - bucket[u], dw_beta,
                     &dw[columns[u], 0], n)
    if not want_dx:
        return
    row_start, row_cols, row_coef = _by_row(columns, bucket, entry_rows, coef, rows, False)
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=parallel):
        _combine(w_rows, n, &row_cols[row_start[i]], &row_coef[row_start[i]], row_start[i + 1] - row_start[i],
                 dx_beta, &dx[i, 0], n)


cdef tuple _by_row(const int[::1] columns, const int[::1] bucket, const int[::1] entry_rows, real[::1] coef,
                   Py_ssize_t rows, bint compact):
    """The by_column listing regrouped by row (a counting sort, one pass over the entries; within
    a row its columns stay in increasing order): (row_start, each entry's column, or with compact
    its place u in `columns`, each entry's coefficient)."""
    cdef Py_ssize_t u, k, r, pos, listed = entry_rows.shape[0], distinct = columns.shape[0]
    cdef int[::1] row_cols = np.empty(max(listed, 1), np.int32)
    cdef int[::1] row_start = np.zeros(rows + 1, np.int32), fill = np.zeros(rows, np.int32)
    cdef real[::1] row_coef = np.empty(max(listed, 1), np.float32 if real is float else np.float64)
    with nogil:
        for k in range(listed):
            row_start[entry_rows[k] + 1] += 1
        for r in range(rows):
            row_start[r + 1] += row_start[r]
            fill[r] = row_start[r]
        for u in range(distinct):
            for k in range(bucket[u], bucket[u + 1]):
                pos = fill[entry_rows[k]]
                fill[entry_rows[k]] = pos + 1
                row_cols[pos], row_coef[pos] = (u if compact else columns[u]), coef[k]
    return row_start, row_cols, row_coef


# ---------------------------------------------------------------- products in bfloat16
# x and the selected rows of w rounded to bfloat16 (round_rows_bf16), their products summed in
# float32: rows of half the bytes, multiplied by vdpbf16ps where the CPU has AVX512-BF16 (rows.h).

def bf16_row_values(long n):
    """16-bit values of a row of n values in bfloat16 (whole pairs: the last padded with zero)."""
    return n + n % 2


def round_rows_bf16(const float[:, ::1] x, const int[::1] rows, unsigned short[:, ::1] out):
    """out[i] = x[rows[i]] (x[i] where rows is None) rounded to bfloat16 (ties to even, NaN stays
    NaN: convert.h), zero-padded to out's width. rows' values were checked by the caller."""
    cdef Py_ssize_t i, j, count = out.shape[0], n = x.shape[1], width = out.shape[1]
    cdef const int* picked = &rows[0] if rows is not None and rows.shape[0] else NULL
    if width != bf16_row_values(n) or (rows is None and count > x.shape[0]) or \
            (rows is not None and rows.shape[0] != count):
        raise ValueError(f"round_rows_bf16: out ({count}, {width}) must be {bf16_row_values(n)} wide and have a row "
                         f"per {'listed row' if rows is not None else 'row of x'} "
                         f"({rows.shape[0] if rows is not None else x.shape[0]})")
    if n == 0:
        return
    for i in prange(count, nogil=True, schedule="static", use_threads_if=count * n > PARALLEL_MIN):
        lamina_to_bfloat16(&x[picked[i] if picked != NULL else i, 0], &out[i, 0], n)
        for j in range(n, width):
            out[i, j] = 0


def selected_dots_bf16(const unsigned short[:, ::1] x, const unsigned short[:, ::1] w, const int[::1] columns,
                       const int[::1] bucket, const int[::1] entries, const int[::1] entry_rows, float[::1] out,
                       double beta):
    """out[e] = x[row(e)] · w[u(e)] + beta * out[e] over rows of bfloat16 values (round_rows_bf16),
    summed in float32: w holds the selected columns' rows in the order of `columns` (w[u] is
    column columns[u]'s), each read once while its entries' rows of x stream past."""
    cdef Py_ssize_t u, k, e, n = x.shape[1], distinct = columns.shape[0]
    cdef int native = lamina_dot_bf16_native()
    cdef float v
    if w.shape[0] != distinct or w.shape[1] != n:
        raise ValueError(f"selected_dots_bf16: w ({w.shape[0]}, {w.shape[1]}) must hold the {distinct} selected "
                         f"columns' rows of {n} values")
    for u in prange(distinct, nogil=True, schedule="static",
                    use_threads_if=entries.shape[0] * n > PARALLEL_MIN):
        if u + PREFETCH_AHEAD < distinct:
            lamina_prefetch(&w[u + PREFETCH_AHEAD, 0], n * sizeof(unsigned short))
        for k in range(bucket[u], bucket[u + 1]):
            e = entries[k]
            v = lamina_dot_bf16(&x[entry_rows[k], 0], &w[u, 0], n, native)
            if beta == 0:
                out[e] = v
            else:
                out[e] = <float>(v + beta * out[e])


def selected_backward_bf16(const float[::1] g, const unsigned short[:, ::1] x, const unsigned short[:, ::1] w,
                           const int[::1] columns, const int[::1] bucket, const int[::1] entries,
                           const int[::1] entry_rows, float[:, ::1] dx, double dx_beta, bint want_dx,
                           float[:, ::1] dw, double dw_beta, bint want_dw):
    """selected_backward with x and the selected rows of w in bfloat16 (as selected_dots_bf16): the
    float32 gradient times their values, summed in float32. dx and dw have the layer's width (x
    and w may hold one more, zero, value a row)."""
    cdef Py_ssize_t u, i, k, n = dx.shape[1] if want_dx else dw.shape[1], rows = x.shape[0]
    cdef Py_ssize_t distinct = columns.shape[0], listed = entries.shape[0]
    cdef bint parallel = listed * n > PARALLEL_MIN
    cdef int[::1] row_cols, row_start
    cdef float[::1] row_coef
    if w.shape[0] != distinct or w.shape[1] != x.shape[1] or x.shape[1] != bf16_row_values(n):
        raise ValueError(f"selected_backward_bf16: x ({x.shape[0]}, {x.shape[1]}) and w ({w.shape[0]}, {w.shape[1]}) "
                         f"must hold rows of {bf16_row_values(n)} values, w one per selected column ({distinct})")
    if n == 0:
        return
    cdef float[::1] coef = np.empty(max(listed, 1), np.float32)
    cdef const unsigned short* x_rows = &x[0, 0] if rows * x.shape[1] else NULL
    cdef const unsigned short* w_rows = &w[0, 0] if distinct * w.shape[1] else NULL
    for k in range(listed):
        coef[k] = g[entries[k]]
    if want_dw:
        for u in prange(distinct, nogil=True, schedule="static", use_threads_if=parallel):
            lamina_combine_rows_bf16(x_rows, x.shape[1], &entry_rows[bucket[u]], &coef[bucket[u]],
                                     bucket[u + 1] - bucket[u], <float>dw_beta, &dw[columns[u], 0], n)
    if not want_dx:
        return
    row_start, row_cols, row_coef = _by_row(columns, bucket, entry_rows, coef, rows, True)
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=parallel):
        lamina_combine_rows_bf16(w_rows, w.shape[1], &row_cols[row_start[i]], &row_coef[row_start[i]],
                                 row_start[i + 1] - row_start[i], <float>dx_beta, &dx[i, 0], n)


def selected_bias_grad(real[::1] g, const int[::1] columns, const int[::1] bucket, const int[::1] entries,
                       real[::1] db, double beta):
    """db[c] = Σ_e g[e] over the entries of column c, for each selected column c (with beta)."""
    cdef Py_ssize_t u, k, distinct = columns.shape[0]
    cdef double acc
    with nogil:
        for u in range(distinct):
            acc = 0
            for k in range(bucket[u], bucket[u + 1]):
                acc = acc + g[entries[k]]
            db[columns[u]] = <real>(acc if beta == 0 else acc + beta * db[columns[u]])


def gather_add(real[::1] b, const int[::1] cols, real[::1] out):
    """out[e] += b[cols[e]] (a bias over the entries of a selection)."""
    cdef Py_ssize_t e, nnz = cols.shape[0]
    with nogil:
        for e in range(nnz):
            out[e] += b[cols[e]]


cdef inline double _weight(const real[::1] w, bint weighted, Py_ssize_t i) noexcept nogil:
    return w[i] if weighted else 1.0


def segment_cross_entropy(real[::1] z, const int[::1] starts, const int[::1] pos, const real[::1] shift,
                          bint shifted, const real[::1] w, bint weighted, real[::1] probs,
                          real[::1] cost):
    """Softmax cross-entropy over each row's entries: with s = z - shift (the sampled-softmax
    logQ correction, or no shift), probs = softmax(s) within the row and
    cost[i] = -w[i] log probs[pos[i]]."""
    cdef Py_ssize_t i, e, rows = cost.shape[0]
    cdef double mx, total, s
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=z.shape[0] > PARALLEL_MIN):
        mx = -1e308
        for e in range(starts[i], starts[i + 1]):
            s = z[e] - (shift[e] if shifted else 0.0)
            if s > mx:
                mx = s
        total = 0
        for e in range(starts[i], starts[i + 1]):
            s = exp(z[e] - (shift[e] if shifted else 0.0) - mx)
            probs[e] = <real>s
            total = total + s
        for e in range(starts[i], starts[i + 1]):
            probs[e] = <real>(probs[e] / total)
        e = pos[i]
        # -log p computed from the shifted scores, exact even where p underflows
        cost[i] = <real>(_weight(w, weighted, i) * (mx + log(total) - (z[e] - (shift[e] if shifted else 0.0))))


def segment_cross_entropy_backward(real[::1] probs, const int[::1] starts, const int[::1] pos, const real[::1] w,
                                   bint weighted, real[::1] dcost, real[::1] dz, double beta):
    """dz[e] = dcost[i] w[i] (probs[e] - [e == pos[i]]) (with beta)."""
    cdef Py_ssize_t i, e, rows = dcost.shape[0]
    cdef double g, v
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=probs.shape[0] > PARALLEL_MIN):
        g = dcost[i] * _weight(w, weighted, i)
        for e in range(starts[i], starts[i + 1]):
            v = g * (probs[e] - (1.0 if e == pos[i] else 0.0))
            dz[e] = <real>(v if beta == 0 else v + beta * dz[e])


def segment_self_normalized(real[::1] o, const int[::1] starts, const int[::1] pos, double alpha,
                            const real[::1] w, bint weighted, real[::1] cost):
    """cost[i] = w[i] (-log o[pos[i]] + log S + alpha (log S)²), S = Σ_row o (o > 0: the
    exponential outputs of the layer)."""
    cdef Py_ssize_t i, e, rows = cost.shape[0]
    cdef double total, ls
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=o.shape[0] > PARALLEL_MIN):
        total = 0
        for e in range(starts[i], starts[i + 1]):
            total = total + o[e]
        ls = log(total)
        cost[i] = <real>(_weight(w, weighted, i) * (-log(o[pos[i]]) + ls + alpha * ls * ls))


def segment_self_normalized_backward(real[::1] o, const int[::1] starts, const int[::1] pos, double alpha,
                                     const real[::1] w, bint weighted, real[::1] dcost, real[::1] do,
                                     double beta):
    """do[e] = dcost[i] w[i] ((1 + 2 alpha log S) / S - [e == pos[i]] / o[e]) (with beta)."""
    cdef Py_ssize_t i, e, rows = dcost.shape[0]
    cdef double total, g, common, v
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=o.shape[0] > PARALLEL_MIN):
        total = 0
        for e in range(starts[i], starts[i + 1]):
            total = total + o[e]
        g = dcost[i] * _weight(w, weighted, i)
        common = (1 + 2 * alpha * log(total)) / total
        for e in range(starts[i], starts[i + 1]):
            v = g * (common - (1.0 / o[e] if e == pos[i] else 0.0))
            do[e] = <real>(v if beta == 0 else v + beta * do[e])


def gather_entries(real[:, ::1] full, const int[::1] starts, const int[::1] cols, bint shared, real[::1] out,
                   double beta):
    """out[e] = full[i, col(e)] for each entry e of row i (with beta); col(e) = cols[e] for a
    per-row selection, cols[e - starts[i]] for a shared one (the dense path's gather)."""
    cdef Py_ssize_t i, e, c, rows = full.shape[0]
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=out.shape[0] > PARALLEL_MIN):
        for e in range(starts[i], starts[i + 1]):
            c = cols[e - starts[i]] if shared else cols[e]
            out[e] = <real>(full[i, c] if beta == 0 else full[i, c] + beta * out[e])


def scatter_entries(real[::1] g, const int[::1] starts, const int[::1] cols, bint shared, real[:, ::1] full):
    """full[i] = 0, then full[i, col(e)] += g[e] for each entry e of row i (the dense path's
    output gradient; a column selected twice gets the sum)."""
    cdef Py_ssize_t i, e, j, c, rows = full.shape[0], n = full.shape[1]
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * n > PARALLEL_MIN):
        for j in range(n):
            full[i, j] = 0
        for e in range(starts[i], starts[i + 1]):
            c = cols[e - starts[i]] if shared else cols[e]
            full[i, c] += g[e]
