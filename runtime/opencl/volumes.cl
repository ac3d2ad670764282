/* Volumes on OpenCL devices: vol2col / col2vol over a block of window rows, and per-channel
 * bias; the same math as pyx/_kernels.pyx. A sample is [C, D, H, W]; the column matrix has one
 * row per (c, a, b, e) tap and one column per window (od, oh, ow) of the rows r = od·oH + oh in
 * [r0, r1). Arrays come as (buffer, offset in elements). */
#ifndef REAL
#define REAL float
#endif
#ifdef USE_DOUBLE
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif
#define ARG(T, x) __global T* x##_base, const int x##_off
#define AT(T, x) __global T* x = x##_base + x##_off
#define WITH_BETA(out, value, beta) ((beta) == 0 ? (value) : (value) + (beta) * (out))

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

/* y[n, c, s] += b[c] */
__kernel void channel_bias(ARG(REAL, y), ARG(const REAL, b), const int N, const int C, const int S)
{
    AT(REAL, y); AT(const REAL, b);
    const int s = get_global_id(0), nc = get_global_id(1);
    if (nc >= N * C || s >= S) return;
    y[nc * S + s] += b[nc % C];
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
