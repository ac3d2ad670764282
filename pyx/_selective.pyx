# cython: language_level=3
"""Kernels of the selective fully-connected layer and its costs.

A selection is CSR over the rows of a batch: row i selects the output columns
cols[starts[i]:starts[i + 1]], and each selected (row, column) is one "entry" e with a value
out[e]. Conventions as in lamina._kernels: C-contiguous arrays, "with beta" outputs
(beta == 0 never reads the output), shapes checked by the caller (lamina.backends.cpu).
"""
from cython.parallel cimport prange
cimport openmp
from libc.math cimport exp, log
import numpy as np

ctypedef fused real:
    float
    double

cdef extern from "rows.h" nogil:
    float lamina_dot_f(const float* a, const float* b, long n)
    double lamina_dot_d(const double* a, const double* b, long n)
    void lamina_axpby_f(float alpha, const float* x, float beta, float* y, long n)
    void lamina_axpby_d(double alpha, const double* x, double beta, double* y, long n)
    void lamina_prefetch(const void* p, long bytes)
    void lamina_stream_copy_f(float* dst, const float* src, long n)
    void lamina_stream_copy_d(double* dst, const double* src, long n)
    void lamina_store_fence()

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


cdef inline void _stream_copy(real* dst, real* src, long n) noexcept nogil:
    if real is float:
        lamina_stream_copy_f(dst, src, n)
    else:
        lamina_stream_copy_d(dst, src, n)


cdef inline void _axpby(double alpha, real* x, double beta, real* y, long n) noexcept nogil:
    if real is float:
        lamina_axpby_f(<float>alpha, x, <float>beta, y, n)
    else:
        lamina_axpby_d(alpha, x, beta, y, n)


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


def selected_backward(real[::1] g, real[:, ::1] x, real[:, ::1] w, const int[::1] columns,
                      const int[::1] bucket, const int[::1] entries, const int[::1] entry_rows,
                      real[:, ::1] dx, double dx_beta, bint want_dx,
                      real[:, ::1] dw, double dw_beta, bint want_dw):
    """One pass over the selected columns c (each row of w read once, each selected row of dw
    written once):
        dx[i] = Σ_e g[e] w[col(e)] over row i's entries      (with dx_beta, if want_dx)
        dw[c] = Σ_e g[e] x[row(e)] over column c's entries   (with dw_beta, if want_dw)
    Threads own ranges of columns; each adds into a private copy of dx, summed at the end, and
    builds each dw row in a private scratch row, stored with non-temporal stores when dw_beta
    is 0 (the row is not read: no need to fetch it first)."""
    cdef Py_ssize_t u, k, e, r, i, j, t, n = x.shape[1], rows = x.shape[0], distinct = columns.shape[0]
    cdef int threads = openmp.omp_get_max_threads()
    cdef bint parallel = entries.shape[0] * n > PARALLEL_MIN
    cdef double b, acc
    cdef real* scratch
    # per thread: rows of private dx, then one scratch row for dw
    cdef real[:, :, ::1] part = np.zeros((threads if parallel else 1, rows + 1, n),
                                         dtype=np.float32 if real is float else np.float64)
    for u in prange(distinct, nogil=True, schedule="static", use_threads_if=parallel):
        t = openmp.omp_get_thread_num()
        scratch = &part[t, rows, 0]
        if u + PREFETCH_AHEAD < distinct:
            if want_dx:
                lamina_prefetch(&w[columns[u + PREFETCH_AHEAD], 0], n * sizeof(real))
            if want_dw and dw_beta != 0:
                lamina_prefetch(&dw[columns[u + PREFETCH_AHEAD], 0], n * sizeof(real))
        b = 0.0
        for k in range(bucket[u], bucket[u + 1]):
            e = entries[k]
            r = entry_rows[k]
            if want_dx:
                _axpby(g[e], &w[columns[u], 0], 1.0, &part[t, r, 0], n)
            if want_dw:
                _axpby(g[e], &x[r, 0], b, scratch, n)
                b = 1.0
        if want_dw:
            if dw_beta == 0:
                _stream_copy(&dw[columns[u], 0], scratch, n)
            else:
                _axpby(1.0, scratch, dw_beta, &dw[columns[u], 0], n)
    lamina_store_fence()
    if want_dx:
        for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * n > PARALLEL_MIN):
            for j in range(n):
                acc = 0
                for t in range(part.shape[0]):
                    acc = acc + part[t, i, j]
                dx[i, j] = <real>(acc if dx_beta == 0 else acc + dx_beta * dx[i, j])


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
