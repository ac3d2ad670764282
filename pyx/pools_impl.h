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

/* The 2x2 window of stride 2 over one output row: input rows r0 and r1 (the row below) at
 * flat position p0 in the plane; LANES outputs at a time (even and odd widths split by shuffles,
 * positions kept as integer vectors), the rest one by one. */
static inline __attribute__((always_inline)) void SUFFIXED(pool_row_2x2)(const REAL *r0, long p0, long W, REAL *o,
                                                                         int *am, long oW) {
    const REAL *r1 = r0 + W;
    long ow = 0;
    for (; ow + LANES <= oW; ow += LANES) {
        VEC a0, a1, b0, b1;
        memcpy(&a0, r0 + 2 * ow, sizeof a0);
        memcpy(&a1, r0 + 2 * ow + LANES, sizeof a1);
        memcpy(&b0, r1 + 2 * ow, sizeof b0);
        memcpy(&b1, r1 + 2 * ow + LANES, sizeof b1);
        IVEC at = (IVEC)POOL_LANE_X2 + POOL_INDEX(p0 + 2 * ow);
        VEC best = __builtin_shuffle(a0, a1, (IVEC)POOL_EVENS);
        IVEC best_at = at;
        SUFFIXED(pool_take)(__builtin_shuffle(a0, a1, (IVEC)POOL_ODDS), at + 1, &best, &best_at);
        SUFFIXED(pool_take)(__builtin_shuffle(b0, b1, (IVEC)POOL_EVENS), at + POOL_INDEX(W), &best, &best_at);
        SUFFIXED(pool_take)(__builtin_shuffle(b0, b1, (IVEC)POOL_ODDS), at + POOL_INDEX(W + 1), &best, &best_at);
        memcpy(o + ow, &best, sizeof best);
        for (long l = 0; l < LANES; l++) am[ow + l] = (int)best_at[l];
    }
    for (; ow < oW; ow++) {
        long i = 2 * ow, at = i;
        REAL best = r0[i];
        if (r0[i + 1] > best) { best = r0[i + 1]; at = i + 1; }
        if (r1[i] > best) { best = r1[i]; at = i + W; }
        if (r1[i + 1] > best) { best = r1[i + 1]; at = i + W + 1; }
        o[ow] = best;
        am[ow] = (int)(p0 + at);
    }
}

/* out [oD][oH][oW] = the maximum of each window of x [D][H][W], argmax its flat position in x
 * (the first of equal maxima, as the generic loop: only a greater value replaces). geo: kd, kh,
 * kw, sd, sh, sw; the caller has checked that every window lies inside x. */
LAMINA_CLONES static void SUFFIXED(max_pool_inside)(const REAL *restrict x, long H, long W, REAL *restrict out,
                                                    int *restrict argmax, long oD, long oH, long oW,
                                                    const long *geo) {
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    const int two_by_two = kd == 1 && kh == 2 && kw == 2 && sh == 2 && sw == 2;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++) {
            REAL *restrict o = out + (od * oH + oh) * oW;
            int *restrict am = argmax + (od * oH + oh) * oW;
            const long base = (od * sd * H + oh * sh) * W;
            if (two_by_two) {
                SUFFIXED(pool_row_2x2)(x + base, base, W, o, am, oW);
                continue;
            }
            for (long ow = 0; ow < oW; ow++) {
                o[ow] = x[base + ow * sw];
                am[ow] = (int)(base + ow * sw);
            }
            for (long a = 0; a < kd; a++)
                for (long b = 0; b < kh; b++)
                    for (long e = 0; e < kw; e++) {
                        if (a == 0 && b == 0 && e == 0) continue;
                        const long tap = base + (a * H + b) * W + e;
                        const REAL *restrict row = x + tap;
                        for (long ow = 0; ow < oW; ow++) {
                            REAL v = row[ow * sw];
                            int greater = v > o[ow];
                            o[ow] = greater ? v : o[ow];
                            am[ow] = greater ? (int)(tap + ow * sw) : am[ow];
                        }
                    }
        }
}

#undef POOL_INDEX
#undef POOL_EVENS
#undef POOL_ODDS
#undef POOL_LANE_X2
