/* The selective layer and its costs on OpenCL devices; the same math as pyx/_selective.pyx.
 * A selection's entries come both ways: row-major (CSR: starts, cols) and grouped by column
 * (CSC: columns, bucket starts, entries, entry rows, and the column of each CSC position), so
 * every kernel writes its outputs without races. Arrays come as (buffer, offset in elements). */
#include "common.h"

/* out[e] = x[row(e)] · w[col(e)] (with beta): one work-item per entry */
__kernel void selected_dots(ARG(const REAL, x), ARG(const REAL, w), ARG(const int, entries),
                            ARG(const int, entry_rows), ARG(const int, entry_cols), ARG(REAL, out),
                            const REAL beta, const int nnz, const int n)
{
    AT(const REAL, x); AT(const REAL, w); AT(const int, entries); AT(const int, entry_rows);
    AT(const int, entry_cols); AT(REAL, out);
    const int k = get_global_id(0);
    if (k >= nnz) return;
    __global const REAL* xr = x + entry_rows[k] * n;
    __global const REAL* wr = w + entry_cols[k] * n;
    REAL acc = 0;
    for (int j = 0; j < n; j++) acc += xr[j] * wr[j];
    const int e = entries[k];
    out[e] = WITH_BETA(out[e], acc, beta);
}

/* dx[i, j] = Σ_e g[e] w[cols[e], j] over row i's entries (with beta) */
__kernel void selected_input_grad(ARG(const REAL, g), ARG(const REAL, w), ARG(const int, starts),
                                  ARG(const int, cols), ARG(REAL, dx), const REAL beta, const int rows, const int n)
{
    AT(const REAL, g); AT(const REAL, w); AT(const int, starts); AT(const int, cols); AT(REAL, dx);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= rows || j >= n) return;
    REAL acc = 0;
    for (int e = starts[i]; e < starts[i + 1]; e++) acc += g[e] * w[cols[e] * n + j];
    dx[i * n + j] = WITH_BETA(dx[i * n + j], acc, beta);
}

/* dw[c, j] = Σ_e g[e] x[row(e), j] over column c's entries, for each selected column (with beta) */
__kernel void selected_weight_grad(ARG(const REAL, g), ARG(const REAL, x), ARG(const int, columns),
                                   ARG(const int, bucket), ARG(const int, entries), ARG(const int, entry_rows),
                                   ARG(REAL, dw), const REAL beta, const int distinct, const int n)
{
    AT(const REAL, g); AT(const REAL, x); AT(const int, columns); AT(const int, bucket);
    AT(const int, entries); AT(const int, entry_rows); AT(REAL, dw);
    const int j = get_global_id(0), u = get_global_id(1);
    if (u >= distinct || j >= n) return;
    REAL acc = 0;
    for (int k = bucket[u]; k < bucket[u + 1]; k++) acc += g[entries[k]] * x[entry_rows[k] * n + j];
    const int o = columns[u] * n + j;
    dw[o] = WITH_BETA(dw[o], acc, beta);
}

__kernel void selected_bias_grad(ARG(const REAL, g), ARG(const int, columns), ARG(const int, bucket),
                                 ARG(const int, entries), ARG(REAL, db), const REAL beta, const int distinct)
{
    AT(const REAL, g); AT(const int, columns); AT(const int, bucket); AT(const int, entries); AT(REAL, db);
    const int u = get_global_id(0);
    if (u >= distinct) return;
    REAL acc = 0;
    for (int k = bucket[u]; k < bucket[u + 1]; k++) acc += g[entries[k]];
    db[columns[u]] = WITH_BETA(db[columns[u]], acc, beta);
}

__kernel void add_selected_bias(ARG(REAL, out), ARG(const REAL, b), ARG(const int, cols), const int width,
                                const int nnz)
{
    AT(REAL, out); AT(const REAL, b); AT(const int, cols);
    const int e = get_global_id(0);
    if (e < nnz) out[e] = (cols[e] < 0 || cols[e] >= width) ? NAN : out[e] + b[cols[e]];
}

/* the dense path: out[e] = full[i, col(e)] (with beta); col(e) = cols[e], or cols[e - starts[i]]
 * for a shared selection. One work-item per row. */
__kernel void gather_entries(ARG(const REAL, full), ARG(const int, starts), ARG(const int, cols), const int shared,
                             ARG(REAL, out), const REAL beta, const int rows, const int width)
{
    AT(const REAL, full); AT(const int, starts); AT(const int, cols); AT(REAL, out);
    const int i = get_global_id(0);
    if (i >= rows) return;
    for (int e = starts[i]; e < starts[i + 1]; e++) {
        const int c = shared ? cols[e - starts[i]] : cols[e];
        out[e] = WITH_BETA(out[e], full[i * width + c], beta);
    }
}

__kernel void scatter_entries(ARG(const REAL, g), ARG(const int, starts), ARG(const int, cols), const int shared,
                              ARG(REAL, full), const int rows, const int width)
{
    AT(const REAL, g); AT(const int, starts); AT(const int, cols); AT(REAL, full);
    const int i = get_global_id(0);
    if (i >= rows) return;
    for (int j = 0; j < width; j++) full[i * width + j] = 0;
    for (int e = starts[i]; e < starts[i + 1]; e++)
        full[i * width + (shared ? cols[e - starts[i]] : cols[e])] += g[e];
}

/* ---- costs over each row's entries: one work-item per row */

__kernel void segment_cross_entropy(ARG(const REAL, z), ARG(const int, starts), ARG(const int, pos),
                                    ARG(const REAL, shift), const int shifted, ARG(const REAL, w), const int weighted,
                                    ARG(REAL, probs), ARG(REAL, cost), const int rows)
{
    AT(const REAL, z); AT(const int, starts); AT(const int, pos); AT(const REAL, shift); AT(const REAL, w);
    AT(REAL, probs); AT(REAL, cost);
    const int i = get_global_id(0);
    if (i >= rows) return;
    REAL m = -INFINITY;
    for (int e = starts[i]; e < starts[i + 1]; e++) m = fmax(m, z[e] - (shifted ? shift[e] : 0));
    REAL total = 0;
    for (int e = starts[i]; e < starts[i + 1]; e++) {
        probs[e] = exp(z[e] - (shifted ? shift[e] : 0) - m);
        total += probs[e];
    }
    for (int e = starts[i]; e < starts[i + 1]; e++) probs[e] /= total;
    const int p = pos[i];
    cost[i] = (weighted ? w[i] : 1) * (m + log(total) - (z[p] - (shifted ? shift[p] : 0)));
}

__kernel void segment_cross_entropy_backward(ARG(const REAL, probs), ARG(const int, starts), ARG(const int, pos),
                                             ARG(const REAL, w), const int weighted, ARG(const REAL, dcost),
                                             ARG(REAL, dz), const REAL beta, const int rows)
{
    AT(const REAL, probs); AT(const int, starts); AT(const int, pos); AT(const REAL, w); AT(const REAL, dcost);
    AT(REAL, dz);
    const int i = get_global_id(0);
    if (i >= rows) return;
    const REAL g = dcost[i] * (weighted ? w[i] : 1);
    for (int e = starts[i]; e < starts[i + 1]; e++)
        dz[e] = WITH_BETA(dz[e], g * (probs[e] - (e == pos[i] ? 1 : 0)), beta);
}

__kernel void segment_self_normalized(ARG(const REAL, o), ARG(const int, starts), ARG(const int, pos),
                                      const REAL alpha, ARG(const REAL, w), const int weighted, ARG(REAL, cost),
                                      const int rows)
{
    AT(const REAL, o); AT(const int, starts); AT(const int, pos); AT(const REAL, w); AT(REAL, cost);
    const int i = get_global_id(0);
    if (i >= rows) return;
    REAL total = 0;
    for (int e = starts[i]; e < starts[i + 1]; e++) total += o[e];
    const REAL ls = log(total);
    cost[i] = (weighted ? w[i] : 1) * (-log(o[pos[i]]) + ls + alpha * ls * ls);
}

__kernel void segment_self_normalized_backward(ARG(const REAL, o), ARG(const int, starts), ARG(const int, pos),
                                               const REAL alpha, ARG(const REAL, w), const int weighted,
                                               ARG(const REAL, dcost), ARG(REAL, d), const REAL beta, const int rows)
{
    AT(const REAL, o); AT(const int, starts); AT(const int, pos); AT(const REAL, w); AT(const REAL, dcost);
    AT(REAL, d);
    const int i = get_global_id(0);
    if (i >= rows) return;
    REAL total = 0;
    for (int e = starts[i]; e < starts[i + 1]; e++) total += o[e];
    const REAL g = dcost[i] * (weighted ? w[i] : 1);
    const REAL common = (1 + 2 * alpha * log(total)) / total;
    for (int e = starts[i]; e < starts[i + 1]; e++)
        d[e] = WITH_BETA(d[e], g * (common - (e == pos[i] ? 1 / o[e] : 0)), beta);
}
