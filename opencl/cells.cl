/* Recurrent cells on OpenCL devices: one work-item per (row, hidden unit) of a step's block,
 * the same math as pyx/cells_impl.h. Arrays come as (buffer, offset in elements); a NULL
 * previous state is passed as has_prev = 0. -D REAL=float|double. */
#include "common.h"

inline REAL sigm(const REAL x) { return (REAL)0.5 + (REAL)0.5 * tanh((REAL)0.5 * x); }


/* g: [rows, 4H] gate pre-activations in, activated i, f, g, o out; c = f c_prev + i g; h = o tanh(c) */
__kernel void lstm_step(ARG(REAL, g), ARG(const REAL, c_prev), const int has_prev, ARG(REAL, c), ARG(REAL, h),
                        const int rows, const int H)
{
    AT(REAL, g); AT(const REAL, c_prev); AT(REAL, c); AT(REAL, h);
    const int j = get_global_id(0), r = get_global_id(1);
    if (r >= rows || j >= H) return;
    __global REAL* gr = g + r * 4 * H;
    const REAL gi = sigm(gr[j]), gf = sigm(gr[H + j]), gg = tanh(gr[2 * H + j]), go = sigm(gr[3 * H + j]);
    gr[j] = gi; gr[H + j] = gf; gr[2 * H + j] = gg; gr[3 * H + j] = go;
    const REAL cv = gi * gg + (has_prev ? gf * c_prev[r * H + j] : 0);
    c[r * H + j] = cv;
    h[r * H + j] = go * tanh(cv);
}

/* dg from dh and the carried cell gradient dc; dc_prev += (dc + dh o tanh'(c)) f unless absent */
__kernel void lstm_step_backward(ARG(const REAL, g), ARG(const REAL, c_prev), const int has_prev,
                                 ARG(const REAL, c), ARG(const REAL, dh), ARG(const REAL, dc), ARG(REAL, dg),
                                 ARG(REAL, dc_prev), const int has_dc_prev, const int rows, const int H)
{
    AT(const REAL, g); AT(const REAL, c_prev); AT(const REAL, c); AT(const REAL, dh); AT(const REAL, dc);
    AT(REAL, dg); AT(REAL, dc_prev);
    const int j = get_global_id(0), r = get_global_id(1);
    if (r >= rows || j >= H) return;
    __global const REAL* gr = g + r * 4 * H;
    __global REAL* dgr = dg + r * 4 * H;
    const int o = r * H + j;
    const REAL gi = gr[j], gf = gr[H + j], gg = gr[2 * H + j], go = gr[3 * H + j];
    const REAL tc = tanh(c[o]);
    const REAL dct = dc[o] + dh[o] * go * (1 - tc * tc);
    dgr[j] = dct * gg * gi * (1 - gi);
    dgr[H + j] = has_prev ? dct * c_prev[o] * gf * (1 - gf) : 0;
    dgr[2 * H + j] = dct * gi * (1 - gg * gg);
    dgr[3 * H + j] = dh[o] * tc * go * (1 - go);
    if (has_dc_prev) dc_prev[o] += dct * gf;
}

/* g: [rows, 3H] input parts in, activated r, z, n out; hh = h_prev W_hhᵀ + b_hh;
 * h = (1 - z) n + z h_prev, n = tanh(g_n + r hh_n) */
__kernel void gru_step(ARG(REAL, g), ARG(const REAL, hh), ARG(const REAL, h_prev), const int has_prev,
                       ARG(REAL, h), const int rows, const int H)
{
    AT(REAL, g); AT(const REAL, hh); AT(const REAL, h_prev); AT(REAL, h);
    const int j = get_global_id(0), r = get_global_id(1);
    if (r >= rows || j >= H) return;
    __global REAL* gr = g + r * 3 * H;
    __global const REAL* hr = hh + r * 3 * H;
    const REAL rg = sigm(gr[j] + hr[j]);
    const REAL z = sigm(gr[H + j] + hr[H + j]);
    const REAL n = tanh(gr[2 * H + j] + rg * hr[2 * H + j]);
    gr[j] = rg; gr[H + j] = z; gr[2 * H + j] = n;
    h[r * H + j] = (1 - z) * n + (has_prev ? z * h_prev[r * H + j] : 0);
}

__kernel void gru_step_backward(ARG(const REAL, g), ARG(const REAL, hh), ARG(const REAL, h_prev), const int has_prev,
                                ARG(const REAL, dh), ARG(REAL, dgx), ARG(REAL, dgh), ARG(REAL, dh_prev),
                                const int has_dh_prev, const int rows, const int H)
{
    AT(const REAL, g); AT(const REAL, hh); AT(const REAL, h_prev); AT(const REAL, dh); AT(REAL, dgx);
    AT(REAL, dgh); AT(REAL, dh_prev);
    const int j = get_global_id(0), r = get_global_id(1);
    if (r >= rows || j >= H) return;
    const int o = r * H + j, b = r * 3 * H;
    const REAL rg = g[b + j], z = g[b + H + j], n = g[b + 2 * H + j], d = dh[o];
    const REAL hp = has_prev ? h_prev[o] : 0;
    const REAL dn = d * (1 - z) * (1 - n * n);
    const REAL dz = d * (hp - n) * z * (1 - z);
    const REAL dr = dn * hh[b + 2 * H + j] * rg * (1 - rg);
    dgx[b + j] = dr; dgx[b + H + j] = dz; dgx[b + 2 * H + j] = dn;
    dgh[b + j] = dr; dgh[b + H + j] = dz; dgh[b + 2 * H + j] = dn * rg;
    if (has_dh_prev) dh_prev[o] += d * z;
}
