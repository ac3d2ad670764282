/* 0 where v < 0, v elsewhere */
static inline __attribute__((always_inline)) VEC SUFFIXED(relu)(VEC v) {
    IVEC negative = (IVEC)(v < 0);
    return (VEC)((IVEC)v & ~negative);
}

/* The larger of each lane of a and b, a where they tie or b is NaN (a max pool's "only a greater
 * value replaces"). */
static inline __attribute__((always_inline)) VEC SUFFIXED(pool_max)(VEC a, VEC b) {
    IVEC greater = (IVEC)(b > a);
    return (VEC)(((IVEC)b & greater) | ((IVEC)a & ~greater));
}

/* 0 where v < 0, cap where v > cap, v elsewhere (a bounded ReLU: NaN stays NaN, -0 stays -0) */
static inline __attribute__((always_inline)) VEC SUFFIXED(relu_capped)(VEC v, REAL cap) {
    v = SUFFIXED(relu)(v);
    VEC caps = (VEC){0} + cap;
    IVEC above = (IVEC)(v > caps);
    return (VEC)(((IVEC)caps & above) | ((IVEC)v & ~above));
}

/* r[i][j] <-> r[j][i]: LANES vectors of LANES values transposed in registers. */
static inline __attribute__((always_inline)) void SUFFIXED(transpose)(VEC *r) {
#if LANES == 8
    const IVEC lo = {0, 8, 1, 9, 4, 12, 5, 13}, hi = {2, 10, 3, 11, 6, 14, 7, 15};
    const IVEC pairs_lo = {0, 1, 8, 9, 4, 5, 12, 13}, pairs_hi = {2, 3, 10, 11, 6, 7, 14, 15};
    const IVEC halves_lo = {0, 1, 2, 3, 8, 9, 10, 11}, halves_hi = {4, 5, 6, 7, 12, 13, 14, 15};
    VEC t[8], u[8];
    for (long i = 0; i < 8; i += 2) {
        t[i] = __builtin_shuffle(r[i], r[i + 1], lo);
        t[i + 1] = __builtin_shuffle(r[i], r[i + 1], hi);
    }
    for (long i = 0; i < 8; i += 4) {  /* u[i + j]: widths j and j + 4 of four channels */
        u[i] = __builtin_shuffle(t[i], t[i + 2], pairs_lo);
        u[i + 1] = __builtin_shuffle(t[i], t[i + 2], pairs_hi);
        u[i + 2] = __builtin_shuffle(t[i + 1], t[i + 3], pairs_lo);
        u[i + 3] = __builtin_shuffle(t[i + 1], t[i + 3], pairs_hi);
    }
    for (long j = 0; j < 4; j++) {
        r[j] = __builtin_shuffle(u[j], u[j + 4], halves_lo);
        r[j + 4] = __builtin_shuffle(u[j], u[j + 4], halves_hi);
    }
#else
    const IVEC lo = {0, 4, 2, 6}, hi = {1, 5, 3, 7}, halves_lo = {0, 1, 4, 5}, halves_hi = {2, 3, 6, 7};
    VEC t0 = __builtin_shuffle(r[0], r[1], lo), t1 = __builtin_shuffle(r[0], r[1], hi);
    VEC t2 = __builtin_shuffle(r[2], r[3], lo), t3 = __builtin_shuffle(r[2], r[3], hi);
    r[0] = __builtin_shuffle(t0, t2, halves_lo);
    r[1] = __builtin_shuffle(t1, t3, halves_lo);
    r[2] = __builtin_shuffle(t0, t2, halves_hi);
    r[3] = __builtin_shuffle(t1, t3, halves_hi);
#endif
}

/* dst + i·dst_stride [j] = src + j·src_stride [i] for i, j < LANES: a LANES x LANES block moved
 * between planes and channels-last (either way) through registers */
static inline __attribute__((always_inline)) void SUFFIXED(transpose_block)(const REAL *src, long src_stride,
                                                                            REAL *dst, long dst_stride) {
    VEC r[LANES];
    for (long i = 0; i < LANES; i++) __builtin_memcpy(&r[i], src + i * src_stride, sizeof(VEC));
    SUFFIXED(transpose)(r);
    for (long i = 0; i < LANES; i++) __builtin_memcpy(dst + i * dst_stride, &r[i], sizeof(VEC));
}
