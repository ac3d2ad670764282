/* vol2col / col2vol of one channel for the REAL type volumes.h sets. `last`: the highest index
 * that may be read (gathers: the end of the channel) or written (scatters: the end of the input
 * row) from the run's start. */

/* shuffle masks: the even lanes of two vectors; two vectors' worth interleaved with zeros */
#if LANES == 8
#define EVENS {0, 2, 4, 6, 8, 10, 12, 14}
#define ZIP_LO {0, 8, 1, 9, 2, 10, 3, 11}
#define ZIP_HI {4, 12, 5, 13, 6, 14, 7, 15}
#define ZIP_HI_BACK {8, 4, 8, 5, 8, 6, 8, 7}
#define IOTA {0, 1, 2, 3, 4, 5, 6, 7}
#else
#define EVENS {0, 2, 4, 6}
#define ZIP_LO {0, 4, 1, 5}
#define ZIP_HI {2, 6, 3, 7}
#define ZIP_HI_BACK {4, 2, 4, 3}
#define IOTA {0, 1, 2, 3}
#endif

/* LANES values dst[i] = src[2·i] from two vectors of src (reading src[2·LANES - 1]) */
static inline __attribute__((always_inline)) void SUFFIXED(gather_evens)(REAL *dst, const REAL *src) {
    VEC a, b;
    memcpy(&a, src, sizeof a);
    memcpy(&b, src + LANES, sizeof b);
    VEC even = __builtin_shuffle(a, b, (IVEC)EVENS);
    memcpy(dst, &even, sizeof even);
}

/* dst[i] = src[i·s], i < n. With s = 2 the last vector, when n is not a whole number of them,
 * moves back to end at dst[n - 1] (writing some values again, the same), where src holds the
 * one value it reads past src[2·(n - 1)]: `last` is the highest index of src that may be read
 * (the odd places read are discarded). */
static inline __attribute__((always_inline)) void SUFFIXED(gather_run)(REAL *restrict dst, const REAL *restrict src,
                                                                       long n, long s, long last) {
    long i = 0;
    if (s == 1) {
        for (; i < n; i++) dst[i] = src[i];
    } else if (s == 2) {
        for (; i + LANES <= n && 2 * i + 2 * LANES - 1 <= last; i += LANES)
            SUFFIXED(gather_evens)(dst + i, src + 2 * i);
        if (i < n && n >= LANES && 2 * n - 1 <= last) {
            SUFFIXED(gather_evens)(dst + n - LANES, src + 2 * (n - LANES));
            i = n;
        }
        for (; i < n; i++) dst[i] = src[2 * i];
    } else {
        for (; i < n; i++) dst[i] = src[i * s];
    }
}

/* dst[i] += v (LANES values) */
static inline __attribute__((always_inline)) void SUFFIXED(add_vector)(REAL *dst, VEC v) {
    VEC d;
    memcpy(&d, dst, sizeof d);
    d += v;
    memcpy(dst, &d, sizeof d);
}

/* dst[i·s] += src[i], i < n. With s = 2 the values past the last whole vector go in one more
 * vector, ending at src[n - 1], whose lanes already added are set to zero; where that vector's
 * last odd place would fall past `last` (the highest index of dst that may be written), its
 * upper half is stored one place back instead (the place it then starts at is odd: it adds zero
 * there too). The odd places add zero, so a place stored twice keeps its value; the tail of a
 * row (where a window of kernel 3, stride 2 ends in the padding) took the scalar loop before:
 * 7 or 8 of every 16 values. */
static inline __attribute__((always_inline)) void SUFFIXED(scatter_add_run)(REAL *restrict dst, const REAL *restrict src,
                                                                            long n, long s, long last) {
    long i = 0;
    if (s == 1) {
        for (; i < n; i++) dst[i] += src[i];
    } else if (s == 2) {
        const VEC zero = {0};
        for (; i + LANES <= n && 2 * i + 2 * LANES - 1 <= last; i += LANES) {
            VEC v;
            memcpy(&v, src + i, sizeof v);
            SUFFIXED(add_vector)(dst + 2 * i, __builtin_shuffle(v, zero, (IVEC)ZIP_LO));  /* the odd places add zero */
            SUFFIXED(add_vector)(dst + 2 * i + LANES, __builtin_shuffle(v, zero, (IVEC)ZIP_HI));
        }
        if (i < n && n >= LANES && 2 * (n - 1) <= last) {
            long base = n - LANES;
            VEC v;
            memcpy(&v, src + base, sizeof v);
            const IVEC done = (IVEC){0} + (int)(i - base);  /* (< LANES) */
            v = (VEC)((IVEC)v & ((IVEC)IOTA >= done));  /* lanes added already: zero */
            SUFFIXED(add_vector)(dst + 2 * base, __builtin_shuffle(v, zero, (IVEC)ZIP_LO));
            if (2 * n - 1 <= last)
                SUFFIXED(add_vector)(dst + 2 * base + LANES, __builtin_shuffle(v, zero, (IVEC)ZIP_HI));
            else
                SUFFIXED(add_vector)(dst + 2 * base + LANES - 1, __builtin_shuffle(v, zero, (IVEC)ZIP_HI_BACK));
            i = n;
        }
        for (; i < n; i++) dst[2 * i] += src[i];
    } else {
        for (; i < n; i++) dst[i * s] += src[i];
    }
}

/* n zeros; a loop, not memset: the runs here are a few values (the window columns in the
 * padding), where a library call costs more than the stores */
static inline __attribute__((always_inline)) void SUFFIXED(zero_run)(REAL *dst, long n) {
    for (long i = 0; i < n; i++) {
        dst[i] = 0;
        __asm__("" ::: "memory");  /* keeps gcc from turning the loop back into a memset call */
    }
}

/* The walk vol2col and col2vol share: for each col row (a, b, e) of one channel x [D, H, W] and
 * each window row r = od·oH + oh in [r0, r1) of an oD x oH x oW grid, the run of input row
 * (i_d, i_h) that the window columns [lo, hi) read. to_col (a constant where this is inlined):
 * col = those runs, zero where the window is in the padding; else x += col over them
 * (accumulates). Window rows are short (oW values), so the per-row work is kept to a few adds. */
static inline __attribute__((always_inline)) void SUFFIXED(volume_walk)(int to_col, REAL *x, long D, long H,
                                                                        long W, REAL *col, long ldcol,
                                                                        const long *geo, long oH, long oW,
                                                                        long r0, long r1) {
    long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    long pd = geo[6], ph = geo[7], pw = geo[8], dd = geo[9], dh = geo[10], dw = geo[11];
    long chunk = oW >= WALK_CHUNK_VALUES ? 1 : WALK_CHUNK_VALUES / oW;
    for (long c0 = r0; c0 < r1; c0 += chunk) {
        long c1 = c0 + chunk < r1 ? c0 + chunk : r1;
        lamina_prefetch_window_rows((const char *)x, D, H, W, sizeof(REAL), geo, oH, c1,
                                    c1 + chunk < r1 ? c1 + chunk : r1, 1);
        lamina_prefetch_window_rows((const char *)x, D, H, W, sizeof(REAL), geo, oH, c1,
                                    c1 + chunk < r1 ? c1 + chunk : r1, !to_col);
        REAL *row = col + (c0 - r0) * oW;
        for (long a = 0; a < kd; a++)
            for (long b = 0; b < kh; b++)
                for (long e = 0; e < kw; e++, row += ldcol) {
                    long off = e * dw - pw, lo, hi;
                    lamina_valid_range(oW, W, sw, off, &lo, &hi);
                    long start = lo * sw + off, last = W - 1 - start;
                    long od = c0 / oH, oh = c0 - od * oH;
                    REAL *c = row;
                    for (long r = c0; r < c1; r++, c += oW) {
                        long i_d = od * sd - pd + a * dd, i_h = oh * sh - ph + b * dh;
                        int inside = i_d >= 0 && i_d < D && i_h >= 0 && i_h < H;
                        if (++oh == oH) {
                            oh = 0;
                            od++;
                        }
                        if (!inside) {  /* the whole window row is in the padding */
                            if (to_col)
                                memset(c, 0, sizeof(REAL) * oW);
                            continue;
                        }
                        REAL *run = x + (i_d * H + i_h) * W + start;
                        if (to_col) {  /* a gather may read on past the row, up to the channel's end */
                            SUFFIXED(zero_run)(c, lo);
                            SUFFIXED(gather_run)(c + lo, run, hi - lo, sw, D * H * W - 1 - (run - x));
                            SUFFIXED(zero_run)(c + hi, oW - hi);
                        } else if (hi > lo) {
                            SUFFIXED(scatter_add_run)(run, c + lo, hi - lo, sw, last);
                        }
                    }
                }
    }
}

/* One window row of a width-stride-2 scatter, all kw taps at once: x_row[iw·2 + e·dw - pw] +=
 * col_e[iw] for iw in [0, oW) and e < kw, where col_e = c + e·ldcol, the places in [0, W) only.
 * The outputs go by blocks of 2·LANES: the even places' vector and the odd places' vector are
 * each the sum of the taps of their parity (col_e read from iw = m0 + (q - off) / 2 on, zero in
 * the lanes past either end of the row), interleaved by two shuffles into one read-add-write of
 * x: per tap, a third of what adding each tap into x by itself costs (its own read and write of
 * the row, and a scalar tail for the half of the row past its last whole vector). */
static inline __attribute__((always_inline)) void SUFFIXED(scatter_add_row_width2)(REAL *restrict dst, long W,
                                                                                   const REAL *restrict c,
                                                                                   long ldcol, long kw, long dw,
                                                                                   long pw, long oW) {
    const VEC zero = {0};
    long ow0 = 0;
    for (; ow0 + 2 * LANES <= W; ow0 += 2 * LANES) {
        VEC even = zero, odd = zero;
        for (long e = 0; e < kw; e++) {
            long off = e * dw - pw, first = ow0 / 2 + ((off & 1) - off) / 2;  /* the exact half of an even number */
            const REAL *row = c + e * ldcol;
            VEC v;
            if (first >= 0 && first + LANES <= oW) {
                memcpy(&v, row + first, sizeof v);
            } else if (oW >= LANES) {  /* past an end of the row: a vector inside it, lanes moved, zeros in */
                long base = first < 0 ? 0 : oW - LANES;
                IVEC place = (IVEC)IOTA + (__typeof__(place[0]))(first - base);
                IVEC at = (IVEC)IOTA + (__typeof__(at[0]))first, inside = (at >= 0) & (at < (__typeof__(at[0]))oW);
                memcpy(&v, row + base, sizeof v);
                v = __builtin_shuffle(v, zero, (place & inside) | (((IVEC){0} + LANES) & ~inside));
            } else {
                REAL part[LANES];
                for (long j = 0; j < LANES; j++)
                    part[j] = first + j >= 0 && first + j < oW ? row[first + j] : 0;
                memcpy(&v, part, sizeof v);
            }
            if (off & 1)
                odd += v;
            else
                even += v;
        }
        SUFFIXED(add_vector)(dst + ow0, __builtin_shuffle(even, odd, (IVEC)ZIP_LO));
        SUFFIXED(add_vector)(dst + ow0 + LANES, __builtin_shuffle(even, odd, (IVEC)ZIP_HI));
    }
    for (; ow0 < W; ow0++)  /* the places past the last whole block */
        for (long e = 0; e < kw; e++) {
            long off = e * dw - pw;
            if (((ow0 - off) & 1) == 0 && ow0 - off >= 0 && (ow0 - off) / 2 < oW)
                dst[ow0] += c[e * ldcol + (ow0 - off) / 2];
        }
}

/* col2vol of one channel with width stride 2, a window row's kw taps at once
 * (scatter_add_row_width2); chunks of window rows as volume_walk. */
static inline __attribute__((always_inline)) void SUFFIXED(col2vol_width2)(const REAL *col, long ldcol, REAL *x,
                                                                           long D, long H, long W, const long *geo,
                                                                           long oH, long oW, long r0, long r1) {
    long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4];
    long pd = geo[6], ph = geo[7], pw = geo[8], dd = geo[9], dh = geo[10], dw = geo[11];
    long chunk = oW >= WALK_CHUNK_VALUES ? 1 : WALK_CHUNK_VALUES / oW;
    for (long c0 = r0; c0 < r1; c0 += chunk) {
        long c1 = c0 + chunk < r1 ? c0 + chunk : r1;
        for (long a = 0; a < kd; a++)
            for (long b = 0; b < kh; b++) {
                const REAL *row = col + (a * kh + b) * kw * ldcol + (c0 - r0) * oW;
                long od = c0 / oH, oh = c0 - od * oH;
                for (long r = c0; r < c1; r++, row += oW) {
                    long i_d = od * sd - pd + a * dd, i_h = oh * sh - ph + b * dh;
                    if (++oh == oH) {
                        oh = 0;
                        od++;
                    }
                    if (i_d >= 0 && i_d < D && i_h >= 0 && i_h < H)
                        SUFFIXED(scatter_add_row_width2)(x + (i_d * H + i_h) * W, W, row, ldcol, kw, dw, pw, oW);
                }
            }
    }
}

/* col rows (a, b, e) of one channel x over window rows [r0, r1) (see lamina._kernels.vol2col):
 * overwrites them, zero where the window is in the padding. */
LAMINA_CLONES static void SUFFIXED(vol2col_channel)(const REAL *x, long D, long H, long W, REAL *col, long ldcol,
                                                    const long *geo, long oH, long oW, long r0, long r1) {
    SUFFIXED(volume_walk)(1, (REAL *)x, D, H, W, col, ldcol, geo, oH, oW, r0, r1);  /* x only read */
}

/* The adjoint: x[...] += the channel's col rows; accumulates. */
LAMINA_CLONES static void SUFFIXED(col2vol_channel)(const REAL *col, long ldcol, REAL *x, long D, long H, long W,
                                                    const long *geo, long oH, long oW, long r0, long r1) {
    if (geo[5] == 2)
        SUFFIXED(col2vol_width2)(col, ldcol, x, D, H, W, geo, oH, oW, r0, r1);
    else
        SUFFIXED(volume_walk)(0, x, D, H, W, (REAL *)col, ldcol, geo, oH, oW, r0, r1);  /* col only read */
}

/* A transposed convolution whose kernel equals its stride (no padding, no dilation) writes every
 * output once: x[od·sd + a][oh·sh + b][ow·sw + e] = col[(a·sh + b)·sw + e][(r - r0)·oW + ow] for
 * the window rows r = od·oH + oh in [r0, r1), x [oD·sd][oH·sh][oW·sw] one channel, col its
 * sd·sh·sw rows (overwrites; "depth to space"). Width stride 2 interleaves two rows by shuffles.
 * The channel's bias (unless bias is NULL) and a ReLU (where relu is set) apply as each value is
 * stored, as the forward kernels' epilogue does (epilogue.h): no pass over the output of their
 * own, and the same values bit for bit. */
LAMINA_CLONES static void SUFFIXED(depth_to_space_channel)(const REAL *col, long ldcol, REAL *x, long sd, long sh,
                                                           long sw, long oH, long oW, long r0, long r1,
                                                           const REAL *bias, int relu) {
    const long H = oH * sh, W = oW * sw;
    const REAL add = bias ? *bias : 0;
    for (long a = 0; a < sd; a++)
        for (long b = 0; b < sh; b++) {
            const REAL *rows = col + (a * sh + b) * sw * ldcol;
            for (long r = r0; r < r1; r++) {
                long od = r / oH, oh = r - od * oH;
                REAL *dst = x + ((od * sd + a) * H + oh * sh + b) * W;
                const REAL *c = rows + (r - r0) * oW;
                long ow = 0;
                if (sw == 2)
                    for (; ow + LANES <= oW; ow += LANES) {
                        VEC v0, v1;
                        memcpy(&v0, c + ow, sizeof v0);
                        memcpy(&v1, c + ldcol + ow, sizeof v1);
                        VEC lo = __builtin_shuffle(v0, v1, (IVEC)ZIP_LO), hi = __builtin_shuffle(v0, v1, (IVEC)ZIP_HI);
                        if (bias) {
                            lo += add;
                            hi += add;
                        }
                        if (relu) {
                            lo = SUFFIXED(relu)(lo);
                            hi = SUFFIXED(relu)(hi);
                        }
                        memcpy(dst + 2 * ow, &lo, sizeof lo);
                        memcpy(dst + 2 * ow + LANES, &hi, sizeof hi);
                    }
                for (; ow < oW; ow++)
                    for (long e = 0; e < sw; e++) {
                        REAL v = c[e * ldcol + ow];
                        if (bias) v += add;
                        dst[ow * sw + e] = relu && v < 0 ? 0 : v;
                    }
            }
        }
}

#undef EVENS
#undef ZIP_LO
#undef ZIP_HI
#undef ZIP_HI_BACK
#undef IOTA
