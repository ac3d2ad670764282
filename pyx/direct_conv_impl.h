/* The sums of one register tile of direct_conv: output channels cb .. cb + LAMINA_CO_BLOCK of
 * the block whose packed weights start at wblk, at output (od, oh), widths w0 .. w0 + 2 LANES,
 * into lo (the first LANES widths) and hi. geo: kd, kh, kw, sd, sh, dd, dh, dw. */
static inline __attribute__((always_inline)) void SUFFIXED(direct_sums)(const REAL *xp, long cin, long Dp, long Hp,
                                                                        long Wp, const REAL *wblk, const long *geo,
                                                                        long od, long oh, long w0, VEC *lo, VEC *hi) {
    const long CB = LAMINA_CO_BLOCK;
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], dd = geo[5], dh = geo[6], dw = geo[7];
    for (long i = 0; i < CB; i++) {
        lo[i] = (VEC){0};
        hi[i] = (VEC){0};
    }
    const REAL *wk = wblk;
    for (long ci = 0; ci < cin; ci++)
        for (long a = 0; a < kd; a++)
            for (long b = 0; b < kh; b++) {
                const REAL *xr = xp + ((ci * Dp + od * sd + a * dd) * Hp + oh * sh + b * dh) * Wp + w0;
                for (long e = 0; e < kw; e++, wk += CB) {
                    VEC x0, x1;
                    memcpy(&x0, xr + e * dw, sizeof x0);
                    memcpy(&x1, xr + e * dw + LANES, sizeof x1);
                    for (long i = 0; i < CB; i++) {
                        VEC wv = wk[i] - (VEC){0};  /* broadcast (v - 0 is exact) */
                        lo[i] += wv * x0;
                        hi[i] += wv * x1;
                    }
                }
            }
}

/* The direct convolution for the REAL type direct_conv.h sets. One group: xp [cin, Dp, Hp, Wp]
 * (padded), wp [ceil(cout / CB)][cin][kd][kh][kw][CB] (zero past cout), y [cout, oD, oH, oW]:
 * overwritten by the sum plus bias[co] (unless bias is NULL), through a ReLU where relu is set
 * (epilogue.h); or, when accumulate is set, added to (no bias, no ReLU). geo: kd, kh, kw, sd,
 * sh, dd, dh, dw. */
LAMINA_CLONES static void SUFFIXED(direct_conv)(const REAL *xp, long cin, long Dp, long Hp, long Wp, const REAL *wp,
                                                long cout, const long *geo, REAL *y, long oD, long oH, long oW,
                                                const REAL *bias, int relu, int accumulate) {
    const long NW = 2 * LANES, CB = LAMINA_CO_BLOCK;
    long g[8];  /* (a local copy: the stores to y cannot change it, so its loads leave the loops) */
    memcpy(g, geo, sizeof g);
    const long per_block = cin * g[0] * g[1] * g[2] * CB;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++)
            for (long cb = 0; cb < cout; cb += CB) {
                long nco = cout - cb < CB ? cout - cb : CB;
                for (long w_tile = 0; w_tile < oW; w_tile += NW) {
                    /* A row's last tile, when partial, moves back to end where the row ends (if the
                     * row holds a whole tile and y is overwritten): whole-vector stores, the
                     * overlapped outputs written again with the same values. */
                    const long w0 = w_tile + NW > oW && oW >= NW && !accumulate ? oW - NW : w_tile;
                    VEC lo[LAMINA_CO_BLOCK], hi[LAMINA_CO_BLOCK];
                    SUFFIXED(direct_sums)(xp, cin, Dp, Hp, Wp, wp + (cb / CB) * per_block, g, od, oh, w0, lo, hi);
                    long n = oW - w0 < NW ? oW - w0 : NW;
#pragma GCC unroll 4
                    for (long i = 0; i < CB; i++) {  /* (unrolled: lo and hi stay in registers) */
                        if (i >= nco)
                            continue;
                        REAL *yr = y + (((cb + i) * oD + od) * oH + oh) * oW + w0;
                        if (!accumulate && bias) {
                            VEC b = (VEC){0} + bias[cb + i];
                            lo[i] += b;
                            hi[i] += b;
                        }
                        if (!accumulate && relu) {
                            lo[i] = SUFFIXED(relu)(lo[i]);
                            hi[i] = SUFFIXED(relu)(hi[i]);
                        }
                        if (n == NW) {  /* a whole tile: two vector stores (a memcpy of n values was a libc call) */
                            if (accumulate) {
                                VEC o0, o1;
                                memcpy(&o0, yr, sizeof o0);
                                memcpy(&o1, yr + LANES, sizeof o1);
                                lo[i] += o0;
                                hi[i] += o1;
                            }
                            memcpy(yr, &lo[i], sizeof lo[i]);
                            memcpy(yr + LANES, &hi[i], sizeof hi[i]);
                            continue;
                        }
                        REAL t[2 * LANES];
                        memcpy(t, &lo[i], sizeof lo[i]);
                        memcpy(t + LANES, &hi[i], sizeof hi[i]);
                        for (long l = 0; l < n; l++) yr[l] = accumulate ? yr[l] + t[l] : t[l];
                    }
                }
            }
}

/* The first and the second width of each window of a tile (lo, hi), in the order one in-lane
 * shuffle gives them (windows 0 1 4 5 2 3 6 7 of 8 floats, 0 2 1 3 of 4 doubles), and the
 * permutation that puts the windows back in order once, at the store. */
#if LANES == 8
#define DIRECT_FIRST_WIDTHS {0, 2, 8, 10, 4, 6, 12, 14}
#define DIRECT_SECOND_WIDTHS {1, 3, 9, 11, 5, 7, 13, 15}
#define DIRECT_WINDOW_ORDER {0, 1, 4, 5, 2, 3, 6, 7}
#else
#define DIRECT_FIRST_WIDTHS {0, 4, 2, 6}
#define DIRECT_SECOND_WIDTHS {1, 5, 3, 7}
#define DIRECT_WINDOW_ORDER {0, 2, 1, 3}
#endif

/* The same convolution followed by a max pool of kernel and stride pool_depth x 2 x 2 (depth,
 * height, width; no padding, sizes rounded down): y [cout, pD, pH, pW] holds only the pool's
 * outputs, the convolution's own never being stored. A tile's 2 LANES widths are LANES windows;
 * each window row's two widths join the running maximum in the pool's order (depth, height,
 * width). The bias and the ReLU apply to the maximum: adding a constant
 * (rounded) and the ReLU never reorder values, so this is the pool of the biased, rectified
 * outputs, to the last bit, NaN included. */
LAMINA_CLONES static void SUFFIXED(direct_conv_pooled)(const REAL *xp, long cin, long Dp, long Hp, long Wp,
                                                       const REAL *wp, long cout, const long *geo, REAL *y, long pD,
                                                       long pH, long pW, long pool_depth, const REAL *bias, int relu) {
    const long CB = LAMINA_CO_BLOCK;
    long g[8];  /* (as in direct_conv) */
    memcpy(g, geo, sizeof g);
    const long per_block = cin * g[0] * g[1] * g[2] * CB;
    const IVEC firsts = DIRECT_FIRST_WIDTHS, seconds = DIRECT_SECOND_WIDTHS, order = DIRECT_WINDOW_ORDER;
    for (long pd = 0; pd < pD; pd++)
        for (long ph = 0; ph < pH; ph++)
            for (long cb = 0; cb < cout; cb += CB) {
                long nco = cout - cb < CB ? cout - cb : CB;
                for (long p_tile = 0; p_tile < pW; p_tile += LANES) {
                    /* the last tile, when partial, moves back to end where the row ends (as above) */
                    const long p0 = p_tile + LANES > pW && pW >= LANES ? pW - LANES : p_tile;
                    VEC best[LAMINA_CO_BLOCK];
                    for (long a = 0; a < pool_depth; a++)
                        for (long b = 0; b < 2; b++) {
                            VEC lo[LAMINA_CO_BLOCK], hi[LAMINA_CO_BLOCK];
                            SUFFIXED(direct_sums)(xp, cin, Dp, Hp, Wp, wp + (cb / CB) * per_block, g,
                                                  pd * pool_depth + a, 2 * ph + b, 2 * p0, lo, hi);
#pragma GCC unroll 4
                            for (long i = 0; i < CB; i++) {
                                VEC first = __builtin_shuffle(lo[i], hi[i], firsts);
                                best[i] = a + b == 0 ? first : SUFFIXED(pool_max)(best[i], first);
                                best[i] = SUFFIXED(pool_max)(best[i], __builtin_shuffle(lo[i], hi[i], seconds));
                            }
                        }
                    long n = pW - p0 < LANES ? pW - p0 : LANES;
                    for (long i = 0; i < nco; i++) {
                        best[i] = __builtin_shuffle(best[i], order);
                        if (bias)
                            best[i] += bias[cb + i];
                        if (relu)
                            best[i] = SUFFIXED(relu)(best[i]);
                        REAL *yr = y + (((cb + i) * pD + pd) * pH + ph) * pW + p0;
                        if (n == LANES) {
                            memcpy(yr, &best[i], sizeof best[i]);
                        } else {
                            REAL t[LANES];
                            memcpy(t, &best[i], sizeof best[i]);
                            for (long l = 0; l < n; l++) yr[l] = t[l];
                        }
                    }
                }
            }
}

/* direct_conv, or with pool_depth 1 or 2 direct_conv_pooled (oD, oH, oW then y's pooled sizes). */
static void SUFFIXED(direct_conv_store)(const REAL *xp, long cin, long Dp, long Hp, long Wp, const REAL *wp, long cout,
                                        const long *geo, REAL *y, long oD, long oH, long oW, const REAL *bias,
                                        int relu, int accumulate, int pool_depth) {
    if (pool_depth)
        SUFFIXED(direct_conv_pooled)(xp, cin, Dp, Hp, Wp, wp, cout, geo, y, oD, oH, oW, pool_depth, bias, relu);
    else
        SUFFIXED(direct_conv)(xp, cin, Dp, Hp, Wp, wp, cout, geo, y, oD, oH, oW, bias, relu, accumulate);
}

#undef DIRECT_FIRST_WIDTHS
#undef DIRECT_SECOND_WIDTHS
#undef DIRECT_WINDOW_ORDER

/* dst [C, Dp, Hp, Wp] = zeros with src [C, D, H, W] at (pd, ph, pw): a sample padded for
 * direct_conv (the caller checked that it fits). */
static void SUFFIXED(direct_pad)(const REAL *src, long C, long D, long H, long W, REAL *dst, long Dp, long Hp, long Wp,
                                 long pd, long ph, long pw) {
    const long plane = Dp * Hp * Wp;
    memset(dst, 0, sizeof(REAL) * C * plane);
    for (long c = 0; c < C; c++)
        for (long d = 0; d < D; d++)
            for (long h = 0; h < H; h++)
                memcpy(dst + c * plane + ((d + pd) * Hp + h + ph) * Wp + pw, src + ((c * D + d) * H + h) * W,
                       sizeof(REAL) * W);
}

/* direct_conv_store for each of `groups` groups: input channels C / groups of xp (planes
 * Dp x Hp x Wp, xp pointing where the windows start), output channels cout / groups of y
 * [cout, oD, oH, oW], and the group's weights as direct_conv packs them (bias: cout values or
 * NULL). */
static void SUFFIXED(direct_conv_groups)(const REAL *xp, long C, long Dp, long Hp, long Wp, const REAL *packed,
                                         long cout, int groups, const long *geo, REAL *y, long oD, long oH, long oW,
                                         const REAL *bias, int relu, int accumulate, int pool_depth) {
    const long in_g = C / groups, out_g = cout / groups;
    const long per_group = (out_g + LAMINA_CO_BLOCK - 1) / LAMINA_CO_BLOCK * in_g * geo[0] * geo[1] * geo[2] *
                           LAMINA_CO_BLOCK;
    for (long g = 0; g < groups; g++)
        SUFFIXED(direct_conv_store)(xp + g * in_g * Dp * Hp * Wp, in_g, Dp, Hp, Wp, packed + g * per_group, out_g, geo,
                                    y + g * out_g * oD * oH * oW, oD, oH, oW, bias ? bias + g * out_g : NULL, relu,
                                    accumulate, pool_depth);
}

/* A member of a team running direct_conv.h's lamina_direct_batch. */
static void SUFFIXED(direct_batch_member)(void *job, int t, int nt) {
    lamina_direct_batch *j = job;
    REAL *xp = j->xp[t];
    for (long n, end = 0; (n = lamina_claim_run(&j->next, j->N, nt, &end)) < j->N;)
    for (; n < end; n++) {
        SUFFIXED(direct_pad)((const REAL *)j->x + n * j->x_stride, j->C, j->D, j->H, j->W, xp, j->Dp, j->Hp, j->Wp,
                             j->pd, j->ph, j->pw);
        SUFFIXED(direct_conv_groups)(xp, j->C, j->Dp, j->Hp, j->Wp, j->packed, j->cout, j->groups, j->geo,
                                     (REAL *)j->y + n * j->y_stride, j->oD, j->oH, j->oW, j->bias, j->relu,
                                     j->accumulate, j->pool_depth);
    }
}
