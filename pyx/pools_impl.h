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

/* POOL_LAST_VECTOR: a row of at least LANES outputs goes in whole vectors, the last one moved
 * back to end where the row ends (its overlap with the one before is computed again, to the same
 * values and positions); a shorter row goes one output at a time. */

/* The 2x2 window of stride 2 over one output row: input rows r0 and r1 (the row below) at
 * flat position p0 in the plane; LANES outputs at a time (even and odd widths split by shuffles,
 * positions kept as integer vectors). */
static inline __attribute__((always_inline)) void SUFFIXED(pool_row_2x2)(const REAL *r0, long p0, long W, REAL *o,
                                                                         int *am, long oW) {
    const REAL *r1 = r0 + W;
    for (long next = 0; oW >= LANES && next < oW; next += LANES) {
        const long ow = next + LANES <= oW ? next : oW - LANES;  /* (POOL_LAST_VECTOR) */
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
    for (long ow = 0; oW < LANES && ow < oW; ow++) {  /* selects, not branches: the winner is data */
        long i = 2 * ow, at = i;
        REAL best = r0[i];
        at = r0[i + 1] > best ? i + 1 : at;
        best = r0[i + 1] > best ? r0[i + 1] : best;
        at = r1[i] > best ? i + W : at;
        best = r1[i] > best ? r1[i] : best;
        at = r1[i + 1] > best ? i + W + 1 : at;
        best = r1[i + 1] > best ? r1[i + 1] : best;
        o[ow] = best;
        am[ow] = (int)(p0 + at);
    }
}

/* The larger of each lane of a and b, a where they tie or b is NaN (as "only a greater value
 * replaces"). */
static inline __attribute__((always_inline)) VEC SUFFIXED(pool_max)(VEC a, VEC b) {
    IVEC greater = (IVEC)(b > a);
    return (VEC)(((IVEC)b & greater) | ((IVEC)a & ~greater));
}

/* pool_row_2x2 without positions (inference: no backward reads them): maxima only, in the same
 * order of comparisons, so the values equal pool_row_2x2's. */
static inline __attribute__((always_inline)) void SUFFIXED(pool_row_2x2_max)(const REAL *r0, long W, REAL *o,
                                                                             long oW) {
    const REAL *r1 = r0 + W;
    for (long next = 0; oW >= LANES && next < oW; next += LANES) {
        const long ow = next + LANES <= oW ? next : oW - LANES;  /* (POOL_LAST_VECTOR) */
        VEC a0, a1, b0, b1;
        memcpy(&a0, r0 + 2 * ow, sizeof a0);
        memcpy(&a1, r0 + 2 * ow + LANES, sizeof a1);
        memcpy(&b0, r1 + 2 * ow, sizeof b0);
        memcpy(&b1, r1 + 2 * ow + LANES, sizeof b1);
        VEC best = SUFFIXED(pool_max)(__builtin_shuffle(a0, a1, (IVEC)POOL_EVENS),
                                      __builtin_shuffle(a0, a1, (IVEC)POOL_ODDS));
        best = SUFFIXED(pool_max)(best, __builtin_shuffle(b0, b1, (IVEC)POOL_EVENS));
        best = SUFFIXED(pool_max)(best, __builtin_shuffle(b0, b1, (IVEC)POOL_ODDS));
        memcpy(o + ow, &best, sizeof best);
    }
    for (long ow = 0; oW < LANES && ow < oW; ow++) {
        long i = 2 * ow;
        REAL best = r0[i];
        best = r0[i + 1] > best ? r0[i + 1] : best;
        best = r1[i] > best ? r1[i] : best;
        best = r1[i + 1] > best ? r1[i + 1] : best;
        o[ow] = best;
    }
}

/* out [oD][oH][oW] = the maximum of each window of x [D][H][W], argmax its flat position in x
 * (the first of equal maxima, as the generic loop: only a greater value replaces), or no
 * positions where argmax is NULL. geo: kd, kh, kw, sd, sh, sw; the caller has checked that every
 * window lies inside x. */
LAMINA_CLONES static void SUFFIXED(max_pool_inside)(const REAL *restrict x, long H, long W, REAL *restrict out,
                                                    int *restrict argmax, long oD, long oH, long oW,
                                                    const long *geo) {
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], sw = geo[5];
    const int two_by_two = kd == 1 && kh == 2 && kw == 2 && sh == 2 && sw == 2;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++) {
            REAL *restrict o = out + (od * oH + oh) * oW;
            int *restrict am = argmax ? argmax + (od * oH + oh) * oW : NULL;
            const long base = (od * sd * H + oh * sh) * W;
            if (two_by_two) {
                if (am)
                    SUFFIXED(pool_row_2x2)(x + base, base, W, o, am, oW);
                else
                    SUFFIXED(pool_row_2x2_max)(x + base, W, o, oW);
                continue;
            }
            for (long ow = 0; ow < oW; ow++) o[ow] = x[base + ow * sw];
            if (am)
                for (long ow = 0; ow < oW; ow++) am[ow] = (int)(base + ow * sw);
            for (long a = 0; a < kd; a++)
                for (long b = 0; b < kh; b++)
                    for (long e = 0; e < kw; e++) {
                        if (a == 0 && b == 0 && e == 0) continue;
                        const long tap = base + (a * H + b) * W + e;
                        const REAL *restrict row = x + tap;
                        if (!am) {
                            for (long ow = 0; ow < oW; ow++) o[ow] = row[ow * sw] > o[ow] ? row[ow * sw] : o[ow];
                            continue;
                        }
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
