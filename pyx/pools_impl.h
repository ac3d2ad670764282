/* a scalar as IVEC's element type (int for floats, long for doubles) */
#define POOL_INDEX(v) ((__typeof__(((IVEC){0})[0]))(v))
#if LANES == 8
#define POOL_EVENS {0, 2, 4, 6, 8, 10, 12, 14}
#define POOL_ODDS {1, 3, 5, 7, 9, 11, 13, 15}
#define POOL_LANE_X2 {0, 2, 4, 6, 8, 10, 12, 14}
#else
#define POOL_EVENS {0, 2, 4, 6}
#define POOL_ODDS {1, 3, 5, 7}
#define POOL_LANE_X2 {0, 2, 4, 6}
#endif

/* One window tap into the running maximum: where v is greater, it and its position win. */
static inline __attribute__((always_inline)) void SUFFIXED(pool_take)(VEC v, IVEC at, VEC *best, IVEC *best_at) {
    IVEC greater = (IVEC)(v > *best);
    *best = (VEC)(((IVEC)v & greater) | ((IVEC)*best & ~greater));
    *best_at = (at & greater) | (*best_at & ~greater);
}

/* The 2x2 windows of stride 2 of LANES outputs from ow on: input rows r0 and r1 (the row below)
 * at flat position p0 in the plane, even and odd widths split by shuffles (reads r0 and r1 up to
 * 2·ow + 2·LANES - 1). The maxima into *best, and where positions is set their flat positions
 * into *best_at (kept as integer vectors). */
static inline __attribute__((always_inline)) void SUFFIXED(pool_vector_2x2)(const REAL *r0, long p0, long W, long ow,
                                                                            int positions, VEC *best, IVEC *best_at) {
    const REAL *r1 = r0 + W;
    VEC a0, a1, b0, b1;
    memcpy(&a0, r0 + 2 * ow, sizeof a0);
    memcpy(&a1, r0 + 2 * ow + LANES, sizeof a1);
    memcpy(&b0, r1 + 2 * ow, sizeof b0);
    memcpy(&b1, r1 + 2 * ow + LANES, sizeof b1);
    VEC even0 = __builtin_shuffle(a0, a1, (IVEC)POOL_EVENS), odd0 = __builtin_shuffle(a0, a1, (IVEC)POOL_ODDS);
    VEC even1 = __builtin_shuffle(b0, b1, (IVEC)POOL_EVENS), odd1 = __builtin_shuffle(b0, b1, (IVEC)POOL_ODDS);
    if (!positions) {
        *best = SUFFIXED(pool_max)(SUFFIXED(pool_max)(SUFFIXED(pool_max)(even0, odd0), even1), odd1);
        return;
    }
    IVEC at = (IVEC)POOL_LANE_X2 + POOL_INDEX(p0 + 2 * ow);
    *best = even0;
    *best_at = at;
    SUFFIXED(pool_take)(odd0, at + 1, best, best_at);
    SUFFIXED(pool_take)(even1, at + POOL_INDEX(W), best, best_at);
    SUFFIXED(pool_take)(odd1, at + POOL_INDEX(W + 1), best, best_at);
}

/* One output row of 2x2 windows of stride 2 from input rows r0 and r1 = r0 + W (flat position
 * p0 in the plane), positions into am unless it is NULL. A row of at least LANES outputs goes in
 * whole vectors, the last one moved back to end where the row ends (its overlap with the one
 * before is computed again, to the same values and positions). A shorter row is one whole vector
 * where `readable` (the values that may be read from r0 on, to the plane's end) holds its reads
 * past the row and `writable` (the outputs from o on, to the plane's end) its stores: the lanes
 * past the row land on the next rows' outputs, which are written after (rows go in order, in one
 * thread per plane). Else one output at a time. */
static inline __attribute__((always_inline)) void SUFFIXED(pool_row_2x2)(const REAL *r0, long p0, long W, REAL *o,
                                                                         int *am, long oW, long readable,
                                                                         long writable) {
    VEC best;
    IVEC best_at = {0};
    if (oW >= LANES) {
        for (long next = 0; next < oW; next += LANES) {
            const long ow = next + LANES <= oW ? next : oW - LANES;
            SUFFIXED(pool_vector_2x2)(r0, p0, W, ow, am != NULL, &best, &best_at);
            memcpy(o + ow, &best, sizeof best);
            if (am)
                for (long l = 0; l < LANES; l++) am[ow + l] = (int)best_at[l];
        }
        return;
    }
    if (W + 2 * LANES <= readable && LANES <= writable) {
        SUFFIXED(pool_vector_2x2)(r0, p0, W, 0, am != NULL, &best, &best_at);
        memcpy(o, &best, sizeof best);
        if (am)
            for (long l = 0; l < LANES; l++) am[l] = (int)best_at[l];
        return;
    }
    const REAL *r1 = r0 + W;
    for (long ow = 0; ow < oW; ow++) {  /* selects, not branches: the winner is data */
        long i = 2 * ow, at = i;
        REAL top = r0[i];
        at = r0[i + 1] > top ? i + 1 : at;
        top = r0[i + 1] > top ? r0[i + 1] : top;
        at = r1[i] > top ? i + W : at;
        top = r1[i] > top ? r1[i] : top;
        at = r1[i + 1] > top ? i + W + 1 : at;
        top = r1[i + 1] > top ? r1[i + 1] : top;
        o[ow] = top;
        if (am) am[ow] = (int)(p0 + at);
    }
}

/* o [n] = the maxima of n windows along a row whose every tap lies inside x [D][H][W]: window
 * ow's first tap at flat position p0 + ow·sw, its taps a·dd, b·dh, e·dw apart (geo: kd, kh, kw,
 * dd, dh, dw); am (unless NULL) their flat positions. Of equal maxima the first tap in window
 * order wins, and a NaN only as the first: only a greater value replaces (the generic loop's
 * rule). */
LAMINA_CLONES static void SUFFIXED(max_pool_row)(const REAL *restrict x, long H, long W, long p0, long n, long sw,
                                                 const long *geo, REAL *restrict o, int *restrict am) {
    const long kd = geo[0], kh = geo[1], kw = geo[2], dd = geo[3], dh = geo[4], dw = geo[5];
    for (long ow = 0; ow < n; ow++) o[ow] = x[p0 + ow * sw];
    if (am)
        for (long ow = 0; ow < n; ow++) am[ow] = (int)(p0 + ow * sw);
    for (long a = 0; a < kd; a++)
        for (long b = 0; b < kh; b++)
            for (long e = 0; e < kw; e++) {
                if (a == 0 && b == 0 && e == 0) continue;
                const long tap = p0 + (a * dd * H + b * dh) * W + e * dw;
                const REAL *restrict row = x + tap;
                if (!am) {
                    for (long ow = 0; ow < n; ow++) o[ow] = row[ow * sw] > o[ow] ? row[ow * sw] : o[ow];
                    continue;
                }
                for (long ow = 0; ow < n; ow++) {
                    REAL v = row[ow * sw];
                    int greater = v > o[ow];
                    o[ow] = greater ? v : o[ow];
                    am[ow] = greater ? (int)(tap + ow * sw) : am[ow];
                }
            }
}

/* out [oD][oH][oW] = the maximum of each window of x [D][H][W], argmax its flat position in x
 * (as max_pool_row), or no positions where argmax is NULL. geo: kd, kh, kw, sd, sh, sw; the
 * caller has checked that every window lies inside x. */
LAMINA_CLONES static void SUFFIXED(max_pool_inside)(const REAL *restrict x, long D, long H, long W,
                                                    REAL *restrict out, int *restrict argmax, long oD, long oH,
                                                    long oW, const long *geo) {
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    const long taps[6] = {kd, kh, kw, 1, 1, 1};
    const int two_by_two = kd == 1 && kh == 2 && kw == 2 && sh == 2 && sw == 2;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++) {
            REAL *restrict o = out + (od * oH + oh) * oW;
            int *restrict am = argmax ? argmax + (od * oH + oh) * oW : NULL;
            const long base = (od * sd * H + oh * sh) * W;
            if (two_by_two) {
                const long readable = D * H * W - base, writable = (oD * oH - od * oH - oh) * oW;
                if (am)
                    SUFFIXED(pool_row_2x2)(x + base, base, W, o, am, oW, readable, writable);
                else  /* (a NULL constant: the compiler drops the positions) */
                    SUFFIXED(pool_row_2x2)(x + base, base, W, o, NULL, oW, readable, writable);
                continue;
            }
            if (am)
                SUFFIXED(max_pool_row)(x, H, W, base, oW, sw, taps, o, am);
            else
                SUFFIXED(max_pool_row)(x, H, W, base, oW, sw, taps, o, NULL);
        }
}

#undef POOL_INDEX
#undef POOL_EVENS
#undef POOL_ODDS
#undef POOL_LANE_X2
