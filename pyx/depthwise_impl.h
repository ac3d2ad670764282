/* The depthwise forward on staged planes (depthwise.h says how the phase planes are laid out),
 * once per element type (instantiate.h). */

static inline __attribute__((always_inline)) VEC SUFFIXED(lamina_dw_load)(const REAL *p) {
    VEC v;
    __builtin_memcpy(&v, p, sizeof v);
    return v;
}

static inline __attribute__((always_inline)) void SUFFIXED(lamina_dw_put)(REAL *p, VEC v) {
    __builtin_memcpy(p, &v, sizeof v);
}

/* lanes 0, 2, 4, … of the two vectors at p */
static inline __attribute__((always_inline)) VEC SUFFIXED(lamina_dw_evens)(const REAL *p) {
    VEC a = SUFFIXED(lamina_dw_load)(p), b = SUFFIXED(lamina_dw_load)(p + LANES);
#if LANES == 8
    return __builtin_shuffle(a, b, (IVEC){0, 2, 4, 6, 8, 10, 12, 14});
#else
    return __builtin_shuffle(a, b, (IVEC){0, 2, 4, 6});
#endif
}

/* q = the phase planes of x [H, W] (ph, pw: the padding before each axis) */
LAMINA_CLONES static void SUFFIXED(lamina_dw_stage)(const REAL *restrict x, long H, long W, long sh, long sw,
                                                    long ph, long pw, long rows, long width, long phase,
                                                    REAL *restrict q) {
    for (long r = 0; r < sh; r++)
        for (long c = 0; c < sw; c++) {
            REAL *restrict dst = q + (r * sw + c) * phase;
            long lo, hi;
            lamina_dw_span(width, W, sw, c - pw, &lo, &hi);
            for (long i = 0; i < rows; i++) {
                REAL *restrict d = dst + i * width;
                long ih = i * sh + r - ph;
                if (ih < 0 || ih >= H) {
                    for (long j = 0; j < width; j++) d[j] = 0;
                    continue;
                }
                const REAL *xr = x + ih * W;
                long j = lo;
                for (long k = 0; k < lo; k++) d[k] = 0;
                if (sw == 1)
                    for (; j < hi; j++) d[j] = xr[j + c - pw];
                if (sw == 2)  /* whole vectors of the even (or odd) columns, while two vectors fit */
                    for (; j + LANES <= hi && 2 * j + c - pw + 2 * LANES <= W; j += LANES)
                        SUFFIXED(lamina_dw_put)(d + j, SUFFIXED(lamina_dw_evens)(xr + 2 * j + c - pw));
                for (; j < hi; j++) d[j] = xr[j * sw + c - pw];
                for (long k = hi; k < width; k++) d[k] = 0;
            }
            for (long j = rows * width; j < phase; j++) dst[j] = 0;
        }
}

/* acc [count] += Σ_taps w[tap] · the tap's phase plane at its offset, count a whole number of
 * LAMINA_DW_BLOCKs: four vectors of outputs stay in registers across the taps */
LAMINA_CLONES static void SUFFIXED(lamina_dw_taps)(const REAL *restrict q, long phase, long width, const REAL *w,
                                                   long kh, long kw, long sh, long sw, long dh, long dw, long count,
                                                   REAL *restrict acc) {
    long offset[LAMINA_DW_TAPS];
    REAL weight[LAMINA_DW_TAPS];
    const long taps = kh * kw;
    for (long t0 = 0; t0 < taps; t0 += LAMINA_DW_TAPS) {
        const long n = taps - t0 < LAMINA_DW_TAPS ? taps - t0 : LAMINA_DW_TAPS;
        for (long t = 0; t < n; t++) {
            long rb = (t0 + t) / kw * dh, ce = (t0 + t) % kw * dw;
            offset[t] = (rb % sh * sw + ce % sw) * phase + rb / sh * width + ce / sw;
            weight[t] = w[t0 + t];
        }
        for (long p0 = 0; p0 < count; p0 += 4 * LANES) {
            REAL *a = acc + p0;
            VEC a0 = SUFFIXED(lamina_dw_load)(a), a1 = SUFFIXED(lamina_dw_load)(a + LANES);
            VEC a2 = SUFFIXED(lamina_dw_load)(a + 2 * LANES), a3 = SUFFIXED(lamina_dw_load)(a + 3 * LANES);
            for (long t = 0; t < n; t++) {
                const REAL *s = q + offset[t] + p0;
                const REAL wt = weight[t];
                a0 += wt * SUFFIXED(lamina_dw_load)(s);
                a1 += wt * SUFFIXED(lamina_dw_load)(s + LANES);
                a2 += wt * SUFFIXED(lamina_dw_load)(s + 2 * LANES);
                a3 += wt * SUFFIXED(lamina_dw_load)(s + 3 * LANES);
            }
            SUFFIXED(lamina_dw_put)(a, a0);
            SUFFIXED(lamina_dw_put)(a + LANES, a1);
            SUFFIXED(lamina_dw_put)(a + 2 * LANES, a2);
            SUFFIXED(lamina_dw_put)(a + 3 * LANES, a3);
        }
    }
}

/* y [oH, oW] = the valid outputs of acc (laid out `width` wide), clamped where clamp is set: 0
 * where v < 0, cap where v > cap (NaN stays NaN, -0 stays -0: the activation kernel's ReLU and
 * bounded ReLU) */
LAMINA_CLONES static void SUFFIXED(lamina_dw_store)(const REAL *restrict acc, long width, long oH, long oW,
                                                    int clamp, REAL cap, REAL *restrict y) {
    for (long oh = 0; oh < oH; oh++) {
        const REAL *restrict a = acc + oh * width;
        REAL *restrict yr = y + oh * oW;
        if (clamp)
            for (long j = 0; j < oW; j++) yr[j] = a[j] < 0 ? 0 : (a[j] > cap ? cap : a[j]);
        else
            for (long j = 0; j < oW; j++) yr[j] = a[j];
    }
}

/* One output row of 3 x 3 windows by channel vectors (lamina_dw_channels): out [oW][LANES] from
 * the staged rows at base, base + ldr, base + 2·ldr, the taps tv [9][LANES] held in registers
 * across the row (the general loop reloads them for every four outputs), four outputs at a time. */
static inline __attribute__((always_inline)) void SUFFIXED(lamina_dw_row3)(const REAL *base, long ldr, long col,
                                                                          long step, const REAL *tv, VEC b,
                                                                          int clamp, REAL cap, long oW,
                                                                          REAL *restrict out) {
    VEC t[9];
    for (long i = 0; i < 9; i++) t[i] = SUFFIXED(lamina_dw_load)(tv + i * LANES);
    long ow = 0;
    for (; ow + 4 <= oW; ow += 4) {
        VEC a0 = b, a1 = b, a2 = b, a3 = b;
        for (long i = 0; i < 9; i++) {
            const REAL *p = base + i / 3 * ldr + i % 3 * col + ow * step;
            a0 += SUFFIXED(lamina_dw_load)(p) * t[i];
            a1 += SUFFIXED(lamina_dw_load)(p + step) * t[i];
            a2 += SUFFIXED(lamina_dw_load)(p + 2 * step) * t[i];
            a3 += SUFFIXED(lamina_dw_load)(p + 3 * step) * t[i];
        }
        SUFFIXED(lamina_dw_put)(out + ow * LANES, clamp ? SUFFIXED(relu_capped)(a0, cap) : a0);
        SUFFIXED(lamina_dw_put)(out + (ow + 1) * LANES, clamp ? SUFFIXED(relu_capped)(a1, cap) : a1);
        SUFFIXED(lamina_dw_put)(out + (ow + 2) * LANES, clamp ? SUFFIXED(relu_capped)(a2, cap) : a2);
        SUFFIXED(lamina_dw_put)(out + (ow + 3) * LANES, clamp ? SUFFIXED(relu_capped)(a3, cap) : a3);
    }
    for (; ow < oW; ow++) {
        VEC a = b;
        for (long i = 0; i < 9; i++) a += SUFFIXED(lamina_dw_load)(base + i / 3 * ldr + i % 3 * col + ow * step) * t[i];
        SUFFIXED(lamina_dw_put)(out + ow * LANES, clamp ? SUFFIXED(relu_capped)(a, cap) : a);
    }
}

/* The forward of up to LANES channels at once, vectors along the channels: for small planes,
 * where one plane per call leaves too few outputs to fill a vector's lanes and the per-plane
 * staging outweighs its taps. x: `lanes` input planes [H, W], in_plane apart; w: their taps
 * [lanes][kh·kw]; bias: their biases or NULL; y: the output planes [oH, oW], out_plane apart,
 * clamped as lamina_dw_store's. stage: lamina_dw_channels_size values: the padded window span
 * [Hs][Ws][LANES] channels-last (lanes past `lanes` zero), the taps [kh·kw][LANES], and one
 * output row [oW rounded up to LANES][LANES]. Rows move between planes and channels-last by
 * LANES x LANES transposes in registers; four outputs of a row at a time stay in registers
 * across all the taps. */
LAMINA_CLONES static void SUFFIXED(lamina_dw_channels)(const REAL *restrict x, long in_plane, long lanes, long H,
                                                       long W, const REAL *w, long kh, long kw, long sh, long sw,
                                                       long ph, long pw, long dh, long dw, const REAL *bias,
                                                       int clamp, REAL cap, REAL *restrict y, long out_plane,
                                                       long oH, long oW, REAL *restrict stage) {
    const long Hs = (oH - 1) * sh + (kh - 1) * dh + 1, Ws = (oW - 1) * sw + (kw - 1) * dw + 1, taps = kh * kw;
    REAL *restrict tv = stage + Hs * Ws * LANES;
    REAL *restrict out = tv + taps * LANES;
    for (long t = 0; t < taps; t++)
        for (long l = 0; l < LANES; l++) tv[t * LANES + l] = l < lanes ? w[l * taps + t] : 0;
    VEC b = {0};
    for (long l = 0; l < lanes && bias; l++) b[l] = bias[l];
    long lo, hi;  /* the staged columns c whose input column c - pw lies inside [0, W) */
    lamina_dw_span(Ws, W, 1, -pw, &lo, &hi);
    for (long r = 0; r < Hs; r++) {
        REAL *restrict row = stage + r * Ws * LANES;
        const long ih = r - ph;
        if (ih < 0 || ih >= H) {
            __builtin_memset(row, 0, Ws * LANES * sizeof(REAL));
            continue;
        }
        __builtin_memset(row, 0, lo * LANES * sizeof(REAL));
        __builtin_memset(row + hi * LANES, 0, (Ws - hi) * LANES * sizeof(REAL));
        const REAL *xr = x + ih * W - pw;  /* (read at columns lo .. hi - 1 of the staged row) */
        long c = lo;
        if (lanes == LANES)
            for (; c + LANES <= hi; c += LANES)
                SUFFIXED(transpose_block)(xr + c, in_plane, row + c * LANES, LANES);
        for (; c < hi; c++)
            for (long l = 0; l < LANES; l++) row[c * LANES + l] = l < lanes ? xr[l * in_plane + c] : 0;
    }
    const long step = sw * LANES;
    for (long oh = 0; oh < oH; oh++) {
        const REAL *base = stage + oh * sh * Ws * LANES;
        if (kh == 3 && kw == 3)
            SUFFIXED(lamina_dw_row3)(base, Ws * dh * LANES, dw * LANES, step, tv, b, clamp, cap, oW, out);
        else
            for (long ow = 0; ow < oW; ow += 4) {
                const long n = oW - ow < 4 ? oW - ow : 4;
                VEC a[4] = {b, b, b, b};
                for (long bb = 0; bb < kh; bb++) {
                    const REAL *r = base + (bb * dh * Ws + ow * sw) * LANES;
                    for (long e = 0; e < kw; e++) {
                        const VEC t = SUFFIXED(lamina_dw_load)(tv + (bb * kw + e) * LANES);
                        const REAL *p = r + e * dw * LANES;
                        if (n == 4) {
                            a[0] += SUFFIXED(lamina_dw_load)(p) * t;
                            a[1] += SUFFIXED(lamina_dw_load)(p + step) * t;
                            a[2] += SUFFIXED(lamina_dw_load)(p + 2 * step) * t;
                            a[3] += SUFFIXED(lamina_dw_load)(p + 3 * step) * t;
                        } else
                            for (long j = 0; j < n; j++) a[j] += SUFFIXED(lamina_dw_load)(p + j * step) * t;
                    }
                }
                for (long j = 0; j < n; j++)
                    SUFFIXED(lamina_dw_put)(out + (ow + j) * LANES, clamp ? SUFFIXED(relu_capped)(a[j], cap) : a[j]);
            }
        REAL *yr = y + oh * oW;
        long ow = 0;
        if (lanes == LANES)
            for (; ow + LANES <= oW; ow += LANES)
                SUFFIXED(transpose_block)(out + ow * LANES, LANES, yr + ow, out_plane);
        for (; ow < oW; ow++)
            for (long l = 0; l < lanes; l++) yr[l * out_plane + ow] = out[ow * LANES + l];
    }
}
