/* vol2col / col2vol of one channel for the REAL type volumes.h sets. `last`: the highest index
 * that may be read or written from the run's start (the end of the input row). */

/* shuffle masks: the even lanes of two vectors; two vectors' worth interleaved with zeros */
#if LANES == 8
#define EVENS {0, 2, 4, 6, 8, 10, 12, 14}
#define ZIP_LO {0, 8, 1, 9, 2, 10, 3, 11}
#define ZIP_HI {4, 12, 5, 13, 6, 14, 7, 15}
#else
#define EVENS {0, 2, 4, 6}
#define ZIP_LO {0, 4, 1, 5}
#define ZIP_HI {2, 6, 3, 7}
#endif

/* dst[i] = src[i·s], i < n */
static inline __attribute__((always_inline)) void SUFFIXED(gather_run)(REAL *restrict dst, const REAL *restrict src,
                                                                       long n, long s, long last) {
    long i = 0;
    if (s == 1) {
        for (; i < n; i++) dst[i] = src[i];
    } else if (s == 2) {
        for (; i + LANES <= n && 2 * i + 2 * LANES - 1 <= last; i += LANES) {
            VEC a, b;
            memcpy(&a, src + 2 * i, sizeof a);
            memcpy(&b, src + 2 * i + LANES, sizeof b);
            VEC even = __builtin_shuffle(a, b, (IVEC)EVENS);
            memcpy(dst + i, &even, sizeof even);
        }
        for (; i < n; i++) dst[i] = src[2 * i];
    } else {
        for (; i < n; i++) dst[i] = src[i * s];
    }
}

/* dst[i·s] += src[i], i < n */
static inline __attribute__((always_inline)) void SUFFIXED(scatter_add_run)(REAL *restrict dst, const REAL *restrict src,
                                                                            long n, long s, long last) {
    long i = 0;
    if (s == 1) {
        for (; i < n; i++) dst[i] += src[i];
    } else if (s == 2) {
        const VEC zero = {0};
        for (; i + LANES <= n && 2 * i + 2 * LANES - 1 <= last; i += LANES) {
            VEC v, d0, d1;
            memcpy(&v, src + i, sizeof v);
            memcpy(&d0, dst + 2 * i, sizeof d0);
            memcpy(&d1, dst + 2 * i + LANES, sizeof d1);
            d0 += __builtin_shuffle(v, zero, (IVEC)ZIP_LO);  /* the odd places add zero */
            d1 += __builtin_shuffle(v, zero, (IVEC)ZIP_HI);
            memcpy(dst + 2 * i, &d0, sizeof d0);
            memcpy(dst + 2 * i + LANES, &d1, sizeof d1);
        }
        for (; i < n; i++) dst[2 * i] += src[i];
    } else {
        for (; i < n; i++) dst[i * s] += src[i];
    }
}

/* col rows (a, b, e) of one channel x [D, H, W] over window rows [r0, r1) of an oH x oW grid
 * (see lamina._kernels.vol2col): overwrites them, zero where the window is in the padding. */
LAMINA_CLONES static void SUFFIXED(vol2col_channel)(const REAL *x, long D, long H, long W, REAL *col, long ldcol,
                                                    const long *geo, long oH, long oW, long r0, long r1) {
    long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    long pd = geo[6], ph = geo[7], pw = geo[8], dd = geo[9], dh = geo[10], dw = geo[11];
    REAL *row = col;
    for (long a = 0; a < kd; a++)
        for (long b = 0; b < kh; b++)
            for (long e = 0; e < kw; e++, row += ldcol) {
                long off = e * dw - pw, lo, hi;
                lamina_valid_range(oW, W, sw, off, &lo, &hi);
                for (long r = r0; r < r1; r++) {
                    long od = r / oH, oh = r - od * oH;
                    long i_d = od * sd - pd + a * dd, i_h = oh * sh - ph + b * dh;
                    REAL *dst = row + (r - r0) * oW;
                    if (i_d < 0 || i_d >= D || i_h < 0 || i_h >= H) {
                        memset(dst, 0, sizeof(REAL) * oW);
                        continue;
                    }
                    const REAL *src = x + (i_d * H + i_h) * W;
                    memset(dst, 0, sizeof(REAL) * lo);
                    SUFFIXED(gather_run)(dst + lo, src + lo * sw + off, hi - lo, sw, W - 1 - (lo * sw + off));
                    memset(dst + hi, 0, sizeof(REAL) * (oW - hi));
                }
            }
}

/* The adjoint: x[...] += the channel's col rows; accumulates. */
LAMINA_CLONES static void SUFFIXED(col2vol_channel)(const REAL *col, long ldcol, REAL *x, long D, long H, long W,
                                                    const long *geo, long oH, long oW, long r0, long r1) {
    long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    long pd = geo[6], ph = geo[7], pw = geo[8], dd = geo[9], dh = geo[10], dw = geo[11];
    const REAL *row = col;
    for (long a = 0; a < kd; a++)
        for (long b = 0; b < kh; b++)
            for (long e = 0; e < kw; e++, row += ldcol) {
                long off = e * dw - pw, lo, hi;
                lamina_valid_range(oW, W, sw, off, &lo, &hi);
                for (long r = r0; r < r1; r++) {
                    long od = r / oH, oh = r - od * oH;
                    long i_d = od * sd - pd + a * dd, i_h = oh * sh - ph + b * dh;
                    if (i_d < 0 || i_d >= D || i_h < 0 || i_h >= H || hi <= lo)
                        continue;
                    REAL *dst = x + (i_d * H + i_h) * W;
                    SUFFIXED(scatter_add_run)(dst + lo * sw + off, row + (r - r0) * oW + lo, hi - lo, sw,
                                              W - 1 - (lo * sw + off));
                }
            }
}

#undef EVENS
#undef ZIP_LO
#undef ZIP_HI
