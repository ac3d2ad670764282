/* Volumes on OpenCL devices: vol2col / col2vol over a block of window rows, and per-channel
 * bias; the same math as pyx/_kernels.pyx. A sample is [C, D, H, W]; the column matrix has one
 * row per (c, a, b, e) tap and one column per window (od, oh, ow) of the rows r = od·oH + oh in
 * [r0, r1). Arrays come as (buffer, offset in elements). */
#include "common.h"

/* geometry: kernel (kd, kh, kw), stride, padding, dilation, grid (oD, oH, oW) */
#define GEOMETRY const int kd, const int kh, const int kw, const int sd, const int sh, const int sw, \
                 const int pd, const int ph, const int pw, const int dd, const int dh, const int dw, \
                 const int oD, const int oH, const int oW

/* col = vol2col(x) for window rows [r0, r1) (overwrites): one work-item per element of col */
__kernel void vol2col(ARG(const REAL, x), const int C, const int D, const int H, const int W, ARG(REAL, col),
                      GEOMETRY, const int r0, const int r1)
{
    AT(const REAL, x); AT(REAL, col);
    const int cols = (r1 - r0) * oW;
    const int p = get_global_id(0), row = get_global_id(1);
    if (p >= cols || row >= C * kd * kh * kw) return;
    const int e = row % kw, b = (row / kw) % kh, a = (row / (kw * kh)) % kd, c = row / (kw * kh * kd);
    const int r = r0 + p / oW, ow = p % oW, od = r / oH, oh = r % oH;
    const int i_d = od * sd - pd + a * dd, i_h = oh * sh - ph + b * dh, i_w = ow * sw - pw + e * dw;
    const int inside = i_d >= 0 && i_d < D && i_h >= 0 && i_h < H && i_w >= 0 && i_w < W;
    col[row * cols + p] = inside ? x[((c * D + i_d) * H + i_h) * W + i_w] : 0;
}

/* x += col2vol(col) for window rows [r0, r1): one work-item per element of x, gathering every
 * tap whose window lands on it (so nothing races) */
__kernel void col2vol(ARG(const REAL, col), ARG(REAL, x), const int C, const int D, const int H, const int W,
                      GEOMETRY, const int r0, const int r1)
{
    AT(const REAL, col); AT(REAL, x);
    const int i = get_global_id(0);
    if (i >= C * D * H * W) return;
    const int i_w = i % W, i_h = (i / W) % H, i_d = (i / (W * H)) % D, c = i / (W * H * D);
    const int cols = (r1 - r0) * oW;
    REAL acc = 0;
    for (int a = 0; a < kd; a++) {
        const int td = i_d + pd - a * dd;
        if (td < 0 || td % sd) continue;
        const int od = td / sd;
        if (od >= oD) continue;
        for (int b = 0; b < kh; b++) {
            const int th = i_h + ph - b * dh;
            if (th < 0 || th % sh) continue;
            const int oh = th / sh;
            const int r = od * oH + oh;
            if (oh >= oH || r < r0 || r >= r1) continue;
            for (int e = 0; e < kw; e++) {
                const int tw = i_w + pw - e * dw;
                if (tw < 0 || tw % sw) continue;
                const int ow = tw / sw;
                if (ow >= oW) continue;
                const int row = ((c * kd + a) * kh + b) * kw + e;
                acc += col[row * cols + (r - r0) * oW + ow];
            }
        }
    }
    x[i] += acc;
}

/* y[n, c, s] = beta·y[n, c, s] + b[c] (beta 0: y's values are not read) */
__kernel void channel_bias(ARG(REAL, y), ARG(const REAL, b), const REAL beta, const int N, const int C,
                           const int S)
{
    AT(REAL, y); AT(const REAL, b);
    const int s = get_global_id(0), nc = get_global_id(1);
    if (nc >= N * C || s >= S) return;
    y[nc * S + s] = WITH_BETA(y[nc * S + s], b[nc % C], beta);
}

/* db[c] = Σ_{n, s} dy[n, c, s] (with beta): one work-item per channel */
__kernel void channel_bias_grad(ARG(const REAL, dy), ARG(REAL, db), const REAL beta, const int N, const int C,
                                const int S)
{
    AT(const REAL, dy); AT(REAL, db);
    const int c = get_global_id(0);
    if (c >= C) return;
    REAL acc = 0;
    for (int n = 0; n < N; n++)
        for (int s = 0; s < S; s++) acc += dy[(n * C + c) * S + s];
    db[c] = WITH_BETA(db[c], acc, beta);
}

/* ---- pooling: planes [P, D, H, W] (N·C planes), window kernel (kd, kh, kw), stride, padding,
 * dilation (the step between a window's taps) */
#define WINDOW const int kd, const int kh, const int kw, const int sd, const int sh, const int sw, \
               const int pd, const int ph, const int pw, const int dd, const int dh, const int dw

/* one work-item per output element; argmax keeps the winner's flat position in its plane */
/* argmax is written where keep_argmax is set (training); inference passes a null buffer */
__kernel void max_pool(ARG(const REAL, x), ARG(REAL, out), ARG(int, argmax), const int keep_argmax, const int P,
                       const int D, const int H, const int W, const int oD, const int oH, const int oW, WINDOW)
{
    AT(const REAL, x); AT(REAL, out);
    const int i = get_global_id(0);
    if (i >= P * oD * oH * oW) return;
    const int ow = i % oW, oh = (i / oW) % oH, od = (i / (oW * oH)) % oD, q = i / (oW * oH * oD);
    __global const REAL* plane = x + q * D * H * W;
    int best_at = -1;
    REAL best = 0;
    for (int a = 0; a < kd; a++) {
        const int i_d = od * sd - pd + a * dd;
        if (i_d < 0 || i_d >= D) continue;
        for (int b = 0; b < kh; b++) {
            const int i_h = oh * sh - ph + b * dh;
            if (i_h < 0 || i_h >= H) continue;
            for (int e = 0; e < kw; e++) {
                const int i_w = ow * sw - pw + e * dw;
                if (i_w < 0 || i_w >= W) continue;
                const int at = (i_d * H + i_h) * W + i_w;
                if (best_at < 0 || plane[at] > best) { best = plane[at]; best_at = at; }
            }
        }
    }
    out[i] = best;
    if (keep_argmax) {
        AT(int, argmax);
        argmax[i] = best_at;
    }
}

/* the output window along one axis whose tap t covers input position i (o·s - p + t·d = i), or -1 */
inline int covering(const int i, const int t, const int s, const int p, const int d, const int n_out)
{
    const int at = i + p - t * d;
    return at >= 0 && at % s == 0 && at / s < n_out ? at / s : -1;
}

/* the taps of one axis of the window at output position o that lie inside [0, n) */
inline int taps_inside(const int o, const int k, const int s, const int p, const int d, const int n)
{
    int count = 0;
    for (int t = 0; t < k; t++) {
        const int i = o * s - p + t * d;
        count += i >= 0 && i < n;
    }
    return count;
}

/* body, for each output window (od, oh, ow) one of whose taps is the input (i_d, i_h, i_w) */
#define FOR_COVERING_WINDOWS(body)                                                                  \
    for (int a = 0; a < kd; a++) {                                                                  \
        const int od = covering(i_d, a, sd, pd, dd, oD);                                            \
        if (od < 0) continue;                                                                       \
        for (int b = 0; b < kh; b++) {                                                              \
            const int oh = covering(i_h, b, sh, ph, dh, oH);                                        \
            if (oh < 0) continue;                                                                   \
            for (int e = 0; e < kw; e++) {                                                          \
                const int ow = covering(i_w, e, sw, pw, dw, oW);                                    \
                if (ow < 0) continue;                                                               \
                body                                                                                \
            }                                                                                       \
        }                                                                                           \
    }

inline int window_count(const int od, const int oh, const int ow, const int D, const int H, const int W, WINDOW,
                        const int count_include_pad)
{
    if (count_include_pad) return kd * kh * kw;
    return taps_inside(od, kd, sd, pd, dd, D) * taps_inside(oh, kh, sh, ph, dh, H) *
           taps_inside(ow, kw, sw, pw, dw, W);
}

/* dx = Σ over the windows whose winner is this element of dy (with beta): one work-item per
 * input element, gathering over the windows whose taps cover it, so overlapping windows never
 * race */
__kernel void max_pool_backward(ARG(const REAL, dy), ARG(const int, argmax), ARG(REAL, dx), const REAL beta,
                                const int P, const int D, const int H, const int W, const int oD, const int oH,
                                const int oW, WINDOW)
{
    AT(const REAL, dy); AT(const int, argmax); AT(REAL, dx);
    const int i = get_global_id(0);
    if (i >= P * D * H * W) return;
    const int at = i % (D * H * W), q = i / (D * H * W);
    const int i_w = at % W, i_h = (at / W) % H, i_d = at / (W * H);
    REAL acc = 0;
    FOR_COVERING_WINDOWS({
        const int o = ((q * oD + od) * oH + oh) * oW + ow;
        if (argmax[o] == at) acc += dy[o];
    })
    dx[i] = WITH_BETA(dx[i], acc, beta);
}

__kernel void avg_pool(ARG(const REAL, x), ARG(REAL, out), const int P, const int D, const int H, const int W,
                       const int oD, const int oH, const int oW, WINDOW, const int count_include_pad)
{
    AT(const REAL, x); AT(REAL, out);
    const int i = get_global_id(0);
    if (i >= P * oD * oH * oW) return;
    const int ow = i % oW, oh = (i / oW) % oH, od = (i / (oW * oH)) % oD, q = i / (oW * oH * oD);
    __global const REAL* plane = x + q * D * H * W;
    REAL acc = 0;
    for (int a = 0; a < kd; a++) {
        const int i_d = od * sd - pd + a * dd;
        if (i_d < 0 || i_d >= D) continue;
        for (int b = 0; b < kh; b++) {
            const int i_h = oh * sh - ph + b * dh;
            if (i_h < 0 || i_h >= H) continue;
            for (int e = 0; e < kw; e++) {
                const int i_w = ow * sw - pw + e * dw;
                if (i_w >= 0 && i_w < W) acc += plane[(i_d * H + i_h) * W + i_w];
            }
        }
    }
    out[i] = acc / window_count(od, oh, ow, D, H, W, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw,
                                count_include_pad);
}

__kernel void avg_pool_backward(ARG(const REAL, dy), ARG(REAL, dx), const REAL beta, const int P, const int D,
                                const int H, const int W, const int oD, const int oH, const int oW, WINDOW,
                                const int count_include_pad)
{
    AT(const REAL, dy); AT(REAL, dx);
    const int i = get_global_id(0);
    if (i >= P * D * H * W) return;
    const int at = i % (D * H * W), q = i / (D * H * W);
    const int i_w = at % W, i_h = (at / W) % H, i_d = at / (W * H);
    REAL acc = 0;
    FOR_COVERING_WINDOWS({
        acc += dy[((q * oD + od) * oH + oh) * oW + ow] /
               window_count(od, oh, ow, D, H, W, kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw, count_include_pad);
    })
    dx[i] = WITH_BETA(dx[i], acc, beta);
}

/* ---- batch normalisation: x [N, C, S]; statistics are C values of the network's type */

/* mean and biased variance per channel (two passes): one work-item per channel */
__kernel void batch_norm_stats(ARG(const REAL, x), ARG(REAL, mean), ARG(REAL, var), const int N, const int C,
                               const int S)
{
    AT(const REAL, x); AT(REAL, mean); AT(REAL, var);
    const int c = get_global_id(0);
    if (c >= C) return;
    REAL acc = 0;
    for (int n = 0; n < N; n++)
        for (int s = 0; s < S; s++) acc += x[(n * C + c) * S + s];
    const REAL m = acc / (N * S);
    acc = 0;
    for (int n = 0; n < N; n++)
        for (int s = 0; s < S; s++) { const REAL d = x[(n * C + c) * S + s] - m; acc += d * d; }
    mean[c] = m;
    var[c] = acc / (N * S);
}

/* training: invstd from the batch variance, running averages updated (the variance unbiased);
 * inference: mean and invstd from the running statistics */
__kernel void batch_norm_statistics(ARG(REAL, mean), ARG(const REAL, var), ARG(REAL, invstd),
                                    ARG(REAL, running_mean), ARG(REAL, running_var), const REAL eps,
                                    const REAL momentum, const REAL unbias, const int training, const int C)
{
    AT(REAL, mean); AT(const REAL, var); AT(REAL, invstd); AT(REAL, running_mean); AT(REAL, running_var);
    const int c = get_global_id(0);
    if (c >= C) return;
    if (training) {
        invstd[c] = 1 / sqrt(var[c] + eps);
        running_mean[c] = (1 - momentum) * running_mean[c] + momentum * mean[c];
        running_var[c] = (1 - momentum) * running_var[c] + momentum * unbias * var[c];
    } else {
        mean[c] = running_mean[c];
        invstd[c] = 1 / sqrt(running_var[c] + eps);
    }
}

__kernel void batch_norm_apply(ARG(const REAL, x), ARG(const REAL, mean), ARG(const REAL, invstd),
                               ARG(const REAL, gamma), ARG(const REAL, beta_), const int affine, const int relu,
                               ARG(REAL, y), const int N, const int C, const int S)
{
    AT(const REAL, x); AT(const REAL, mean); AT(const REAL, invstd); AT(const REAL, gamma); AT(const REAL, beta_);
    AT(REAL, y);
    const int i = get_global_id(0);
    if (i >= N * C * S) return;
    const int c = (i / S) % C;
    const REAL xhat = (x[i] - mean[c]) * invstd[c];
    const REAL v = affine ? xhat * gamma[c] + beta_[c] : xhat;
    y[i] = relu && v < 0 ? 0 : v;  /* (NaN stays NaN, as the activation kernel's ReLU) */
}

/* dgamma = Σ dy x̂, dbeta = Σ dy per channel */
__kernel void batch_norm_sums(ARG(const REAL, x), ARG(const REAL, dy), ARG(const REAL, mean),
                              ARG(const REAL, invstd), ARG(REAL, dgamma), ARG(REAL, dbeta), const int N, const int C,
                              const int S)
{
    AT(const REAL, x); AT(const REAL, dy); AT(const REAL, mean); AT(const REAL, invstd); AT(REAL, dgamma);
    AT(REAL, dbeta);
    const int c = get_global_id(0);
    if (c >= C) return;
    REAL dg = 0, db = 0;
    for (int n = 0; n < N; n++)
        for (int s = 0; s < S; s++) {
            const int i = (n * C + c) * S + s;
            dg += dy[i] * (x[i] - mean[c]) * invstd[c];
            db += dy[i];
        }
    dgamma[c] = dg;
    dbeta[c] = db;
}

/* dx = invstd gamma (dy - dbeta/m - x̂ dgamma/m) with batch statistics, invstd gamma dy without */
__kernel void batch_norm_dx(ARG(const REAL, x), ARG(const REAL, dy), ARG(const REAL, mean), ARG(const REAL, invstd),
                            ARG(const REAL, gamma), const int affine, const int batch_stats, ARG(const REAL, dgamma),
                            ARG(const REAL, dbeta), ARG(REAL, dx), const REAL beta, const int N, const int C,
                            const int S)
{
    AT(const REAL, x); AT(const REAL, dy); AT(const REAL, mean); AT(const REAL, invstd); AT(const REAL, gamma);
    AT(const REAL, dgamma); AT(const REAL, dbeta); AT(REAL, dx);
    const int i = get_global_id(0);
    if (i >= N * C * S) return;
    const int c = (i / S) % C;
    const REAL g = invstd[c] * (affine ? gamma[c] : 1), m = N * S;
    const REAL xhat = (x[i] - mean[c]) * invstd[c];
    const REAL v = batch_stats ? g * (dy[i] - dbeta[c] / m - xhat * dgamma[c] / m) : g * dy[i];
    dx[i] = WITH_BETA(dx[i], v, beta);
}

/* y[o, j, i] = Σ_k weights[j, k] x[o, taps[j, k], i]: one work-item per (i, o·m + j). A tap
 * outside [0, n) (the host checked them) reads nothing. */
__kernel void resample_axis(ARG(const REAL, x), ARG(const int, taps), ARG(const REAL, weights), ARG(REAL, y),
                            const int outer, const int n, const int m, const int inner, const int K)
{
    AT(const REAL, x); AT(const int, taps); AT(const REAL, weights); AT(REAL, y);
    const int i = get_global_id(0), row = get_global_id(1);
    if (i >= inner || row >= outer * m) return;
    const int o = row / m, j = row % m;
    REAL acc = 0;
    for (int k = 0; k < K; k++) {
        const int t = taps[j * K + k];
        if (t >= 0 && t < n) acc += weights[j * K + k] * x[((long)o * n + t) * inner + i];
    }
    y[(long)row * inner + i] = acc;
}

/* dx[o, t, i] = Σ over (j, k) with taps[j, k] = t of weights[j, k] dy[o, j, i] (with beta): one
 * work-item per (i, o) owns that column of dx, so the sums need no atomics */
__kernel void resample_axis_backward(ARG(const REAL, dy), ARG(const int, taps), ARG(const REAL, weights),
                                     ARG(REAL, dx), const REAL beta, const int outer, const int n, const int m,
                                     const int inner, const int K)
{
    AT(const REAL, dy); AT(const int, taps); AT(const REAL, weights); AT(REAL, dx);
    const int i = get_global_id(0), o = get_global_id(1);
    if (i >= inner || o >= outer) return;
    __global REAL *column = dx + (long)o * n * inner + i;
    for (int t = 0; t < n; t++) column[(long)t * inner] = beta == 0 ? 0 : beta * column[(long)t * inner];
    for (int j = 0; j < m; j++) {
        const REAL g = dy[((long)o * m + j) * inner + i];
        for (int k = 0; k < K; k++) {
            const int t = taps[j * K + k];
            if (t >= 0 && t < n) column[(long)t * inner] += weights[j * K + k] * g;
        }
    }
}
