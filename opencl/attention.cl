/* Attention within packed sequences and layer normalization of rows on OpenCL devices: the same
 * math as the CPU kernels (pyx/attention_impl.h, pyx/norms_impl.h); arrays come as (buffer,
 * offset in elements). In attention a row's query, key and value for head h are qkv[r, h*d ..],
 * qkv[r, E + h*d ..] and qkv[r, 2E + h*d ..], d = E / heads; a row attends within its sequence,
 * rows starts[s] .. starts[s+1]. */
#include "common.h"

/* the sequence s holding row r (starts[s] <= r < starts[s + 1]), for 0 <= r < starts[n] */
static int sequence_of(__global const int* starts, const int n, const int r)
{
    int lo = 0, hi = n;
    while (hi - lo > 1) {
        const int mid = (lo + hi) / 2;
        if (starts[mid] <= r) lo = mid; else hi = mid;
    }
    return lo;
}

static REAL dot(__global const REAL* a, __global const REAL* b, const int d)
{
    REAL acc = 0;
    for (int c = 0; c < d; c++) acc += a[c] * b[c];
    return acc;
}

/* one work-item per (head, row): a running maximum and sum over the row's keys, the output
 * accumulated in place and rescaled whenever the maximum rises */
__kernel void attention(ARG(const REAL, qkv), ARG(const int, starts), ARG(REAL, out), ARG(REAL, lse),
                        const REAL scale, const int causal, const int n, const int rows, const int heads, const int E)
{
    AT(const REAL, qkv); AT(const int, starts); AT(REAL, out); AT(REAL, lse);
    const int h = get_global_id(0), i = get_global_id(1);
    if (h >= heads || i >= rows) return;
    const int d = E / heads, ld = 3 * E, s = sequence_of(starts, n, i);
    const int end = causal ? i + 1 : starts[s + 1];
    __global const REAL* q = qkv + i * ld + h * d;
    __global REAL* o = out + i * E + h * d;
    REAL m = -INFINITY, l = 0;
    for (int c = 0; c < d; c++) o[c] = 0;
    for (int j = starts[s]; j < end; j++) {
        __global const REAL* k = qkv + j * ld + E + h * d;
        const REAL score = scale * dot(q, k, d);
        if (score > m) {
            const REAL f = exp(m - score);
            l *= f;
            for (int c = 0; c < d; c++) o[c] *= f;
            m = score;
        }
        const REAL p = exp(score - m);
        l += p;
        for (int c = 0; c < d; c++) o[c] += p * k[E + c];
    }
    for (int c = 0; c < d; c++) o[c] /= l;
    lse[i * heads + h] = m + log(l);
}

/* one work-item per (head, query row): D_i = dout_i·out_i (kept in delta for the keys' pass)
 * and dq_i = scale Σ_j p_ij (dout_i·v_j - D_i) k_j */
__kernel void attention_backward_query(ARG(const REAL, qkv), ARG(const REAL, out), ARG(const REAL, lse),
                                       ARG(const REAL, dout), ARG(const int, starts), ARG(REAL, dqkv),
                                       ARG(REAL, delta), const REAL scale, const int causal, const int n,
                                       const int rows, const int heads, const int E)
{
    AT(const REAL, qkv); AT(const REAL, out); AT(const REAL, lse); AT(const REAL, dout); AT(const int, starts);
    AT(REAL, dqkv); AT(REAL, delta);
    const int h = get_global_id(0), i = get_global_id(1);
    if (h >= heads || i >= rows) return;
    const int d = E / heads, ld = 3 * E, s = sequence_of(starts, n, i);
    const int end = causal ? i + 1 : starts[s + 1];
    __global const REAL* q = qkv + i * ld + h * d;
    __global const REAL* g = dout + i * E + h * d;
    __global REAL* dq = dqkv + i * ld + h * d;
    const REAL D = dot(g, out + i * E + h * d, d), L = lse[i * heads + h];
    delta[i * heads + h] = D;
    for (int c = 0; c < d; c++) dq[c] = 0;
    for (int j = starts[s]; j < end; j++) {
        __global const REAL* k = qkv + j * ld + E + h * d;
        const REAL p = exp(scale * dot(q, k, d) - L);
        const REAL ds = p * (dot(g, k + E, d) - D) * scale;
        for (int c = 0; c < d; c++) dq[c] += ds * k[c];
    }
}

/* one work-item per (head, key row): dk_j = scale Σ_i ds_ij q_i and dv_j = Σ_i p_ij dout_i over
 * the queries that see key j (after attention_backward_query filled delta) */
__kernel void attention_backward_key(ARG(const REAL, qkv), ARG(const REAL, lse), ARG(const REAL, dout),
                                     ARG(const int, starts), ARG(const REAL, delta), ARG(REAL, dqkv),
                                     const REAL scale, const int causal, const int n, const int rows,
                                     const int heads, const int E)
{
    AT(const REAL, qkv); AT(const REAL, lse); AT(const REAL, dout); AT(const int, starts); AT(const REAL, delta);
    AT(REAL, dqkv);
    const int h = get_global_id(0), j = get_global_id(1);
    if (h >= heads || j >= rows) return;
    const int d = E / heads, ld = 3 * E, s = sequence_of(starts, n, j);
    __global const REAL* k = qkv + j * ld + E + h * d;
    __global REAL* dk = dqkv + j * ld + E + h * d;
    for (int c = 0; c < d; c++) dk[c] = dk[E + c] = 0;
    for (int i = causal ? j : starts[s]; i < starts[s + 1]; i++) {
        __global const REAL* q = qkv + i * ld + h * d;
        __global const REAL* g = dout + i * E + h * d;
        const REAL p = exp(scale * dot(q, k, d) - lse[i * heads + h]);
        const REAL ds = p * (dot(g, k + E, d) - delta[i * heads + h]) * scale;
        for (int c = 0; c < d; c++) {
            dk[c] += ds * q[c];
            dk[E + c] += p * g[c];
        }
    }
}

/* one work-item per row: y = (x - μ) rstd γ + β (center 0: μ = 0); has_gamma, has_beta 0: absent */
__kernel void layer_norm(ARG(const REAL, x), ARG(const REAL, gamma), ARG(const REAL, beta), ARG(REAL, y),
                         ARG(REAL, mean), ARG(REAL, rstd), const REAL eps, const int center, const int has_gamma,
                         const int has_beta, const int rows, const int C)
{
    AT(const REAL, x); AT(const REAL, gamma); AT(const REAL, beta); AT(REAL, y); AT(REAL, mean); AT(REAL, rstd);
    const int i = get_global_id(0);
    if (i >= rows) return;
    __global const REAL* xr = x + i * C;
    REAL mu = 0, var = 0;
    if (center) {
        for (int j = 0; j < C; j++) mu += xr[j];
        mu /= C;
    }
    for (int j = 0; j < C; j++) var += (xr[j] - mu) * (xr[j] - mu);
    const REAL r = 1 / sqrt(var / C + eps);
    for (int j = 0; j < C; j++) {
        REAL v = (xr[j] - mu) * r;
        if (has_gamma) v *= gamma[j];
        if (has_beta) v += beta[j];
        y[i * C + j] = v;
    }
    mean[i] = mu;
    rstd[i] = r;
}

/* one work-item per row: dx = rstd (g - mean(g) - x̂ mean(g x̂)), g = dy γ (with beta) */
__kernel void layer_norm_backward(ARG(const REAL, x), ARG(const REAL, dy), ARG(const REAL, mean),
                                  ARG(const REAL, rstd), ARG(const REAL, gamma), ARG(REAL, dx), const REAL beta,
                                  const int center, const int has_gamma, const int rows, const int C)
{
    AT(const REAL, x); AT(const REAL, dy); AT(const REAL, mean); AT(const REAL, rstd); AT(const REAL, gamma);
    AT(REAL, dx);
    const int i = get_global_id(0);
    if (i >= rows) return;
    const REAL mu = mean[i], r = rstd[i];
    REAL sg = 0, sgx = 0;
    for (int j = 0; j < C; j++) {
        const REAL g = dy[i * C + j] * (has_gamma ? gamma[j] : 1);
        sg += g;
        sgx += g * (x[i * C + j] - mu) * r;
    }
    const REAL a = center ? sg / C : 0, b = sgx / C;
    for (int j = 0; j < C; j++) {
        const REAL g = dy[i * C + j] * (has_gamma ? gamma[j] : 1);
        dx[i * C + j] = WITH_BETA(dx[i * C + j], r * (g - a - (x[i * C + j] - mu) * r * b), beta);
    }
}

/* one work-item per column: dγ = Σ_rows dy x̂, dβ = Σ_rows dy, each with its beta */
__kernel void layer_norm_param_grads(ARG(const REAL, x), ARG(const REAL, dy), ARG(const REAL, mean),
                                     ARG(const REAL, rstd), ARG(REAL, dgamma), const REAL gamma_beta,
                                     ARG(REAL, dbeta), const REAL beta_beta, const int has_dgamma,
                                     const int has_dbeta, const int rows, const int C)
{
    AT(const REAL, x); AT(const REAL, dy); AT(const REAL, mean); AT(const REAL, rstd); AT(REAL, dgamma);
    AT(REAL, dbeta);
    const int j = get_global_id(0);
    if (j >= C) return;
    REAL ag = 0, ab = 0;
    for (int i = 0; i < rows; i++) {
        ag += dy[i * C + j] * (x[i * C + j] - mean[i]) * rstd[i];
        ab += dy[i * C + j];
    }
    if (has_dgamma) dgamma[j] = WITH_BETA(dgamma[j], ag, gamma_beta);
    if (has_dbeta) dbeta[j] = WITH_BETA(dbeta[j], ab, beta_beta);
}
