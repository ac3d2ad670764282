/* Sequence batches and sparse row updates on OpenCL devices: pooling to one row per sequence,
 * softmax over each sequence's steps, and optimizer updates of listed rows. Same math as the
 * CPU kernels (pyx/_kernels.pyx); arrays come as (buffer, offset in elements). */
#include "common.h"

/* pooling modes: the positions in lamina.backends.base.POOL_MODES */
#define POOL_LAST 0
#define POOL_FIRST 1
#define POOL_AVERAGE 2
#define POOL_SUM 3
#define POOL_MAX 4

/* one work-item per (sequence, feature) */
__kernel void sequence_pool(const int mode, ARG(const REAL, x), ARG(const int, starts), ARG(REAL, out),
                            ARG(int, argmax), const int n, const int cols)
{
    AT(const REAL, x); AT(const int, starts); AT(REAL, out); AT(int, argmax);
    const int j = get_global_id(0), s = get_global_id(1);
    if (s >= n || j >= cols) return;
    const int a = starts[s], b = starts[s + 1], o = s * cols + j;
    if (mode == POOL_LAST) {
        out[o] = x[(b - 1) * cols + j];
    } else if (mode == POOL_FIRST) {
        out[o] = x[a * cols + j];
    } else if (mode == POOL_MAX) {
        int best = a;
        for (int t = a + 1; t < b; t++)
            if (x[t * cols + j] > x[best * cols + j]) best = t;
        argmax[o] = best;
        out[o] = x[best * cols + j];
    } else {
        REAL acc = 0;
        for (int t = a; t < b; t++) acc += x[t * cols + j];
        out[o] = mode == POOL_AVERAGE ? acc / (b - a) : acc;
    }
}

/* one work-item per (sequence, feature), walking the sequence's rows */
__kernel void sequence_pool_backward(const int mode, ARG(const REAL, dy), ARG(const int, starts),
                                     ARG(const int, argmax), ARG(REAL, dx), const REAL beta, const int n,
                                     const int cols)
{
    AT(const REAL, dy); AT(const int, starts); AT(const int, argmax); AT(REAL, dx);
    const int j = get_global_id(0), s = get_global_id(1);
    if (s >= n || j >= cols) return;
    const int a = starts[s], b = starts[s + 1], o = s * cols + j;
    for (int t = a; t < b; t++) {
        REAL v;
        if (mode == POOL_LAST) v = t == b - 1 ? dy[o] : 0;
        else if (mode == POOL_FIRST) v = t == a ? dy[o] : 0;
        else if (mode == POOL_MAX) v = t == argmax[o] ? dy[o] : 0;
        else if (mode == POOL_AVERAGE) v = dy[o] / (b - a);
        else v = dy[o];
        dx[t * cols + j] = WITH_BETA(dx[t * cols + j], v, beta);
    }
}

/* y = softmax of x over each sequence's steps: one work-item per sequence */
__kernel void sequence_softmax(ARG(const REAL, x), ARG(const int, starts), ARG(REAL, y), const int n)
{
    AT(const REAL, x); AT(const int, starts); AT(REAL, y);
    const int s = get_global_id(0);
    if (s >= n) return;
    const int a = starts[s], b = starts[s + 1];
    REAL m = x[a];
    for (int t = a + 1; t < b; t++) m = fmax(m, x[t]);
    REAL total = 0;
    for (int t = a; t < b; t++) { y[t] = exp(x[t] - m); total += y[t]; }
    for (int t = a; t < b; t++) y[t] = y[t] / total;
}

__kernel void sequence_softmax_backward(ARG(const REAL, y), ARG(const REAL, dy), ARG(const int, starts),
                                        ARG(REAL, dx), const REAL beta, const int n)
{
    AT(const REAL, y); AT(const REAL, dy); AT(const int, starts); AT(REAL, dx);
    const int s = get_global_id(0);
    if (s >= n) return;
    const int a = starts[s], b = starts[s + 1];
    REAL d = 0;
    for (int t = a; t < b; t++) d += dy[t] * y[t];
    for (int t = a; t < b; t++) dx[t] = WITH_BETA(dx[t], y[t] * (dy[t] - d), beta);
}

/* ---- optimizer updates of listed rows: one work-item per (listed row, column) */

__kernel void sgd_update_rows(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, v), ARG(const int, rows_),
                              const REAL lr, const REAL momentum, const REAL dampening, const int nesterov,
                              const int n, const int cols)
{
    AT(REAL, p); AT(const REAL, g); AT(REAL, v); AT(const int, rows_);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= n || j >= cols) return;
    const int o = rows_[i] * cols + j;
    REAL gi = g[o];
    if (momentum != 0) {
        const REAL vi = momentum * v[o] + (1 - dampening) * gi;
        v[o] = vi;
        gi = nesterov ? gi + momentum * vi : vi;
    }
    p[o] -= lr * gi;
}

__kernel void adagrad_update_rows(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, s), ARG(const int, rows_),
                                  const REAL lr, const REAL eps, const int n, const int cols)
{
    AT(REAL, p); AT(const REAL, g); AT(REAL, s); AT(const int, rows_);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= n || j >= cols) return;
    const int o = rows_[i] * cols + j;
    const REAL si = s[o] + g[o] * g[o];
    s[o] = si;
    p[o] -= lr * g[o] / (sqrt(si) + eps);
}

__kernel void adam_update_rows(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, m), ARG(REAL, v), ARG(const int, rows_),
                               const REAL beta1, const REAL beta2, const REAL eps, const REAL step_size,
                               const REAL root_c2, const int n, const int cols)
{
    AT(REAL, p); AT(const REAL, g); AT(REAL, m); AT(REAL, v); AT(const int, rows_);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= n || j >= cols) return;
    const int o = rows_[i] * cols + j;
    const REAL gi = g[o];
    const REAL mi = beta1 * m[o] + (1 - beta1) * gi;
    const REAL vi = beta2 * v[o] + (1 - beta2) * gi * gi;
    m[o] = mi;
    v[o] = vi;
    p[o] -= step_size * mi / (sqrt(vi) / root_c2 + eps);
}
