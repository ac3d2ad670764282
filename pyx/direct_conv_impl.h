/* The direct convolution for the REAL type direct_conv.h sets. One group: xp [cin, Dp, Hp, Wp]
 * (padded), wp [ceil(cout / CB)][cin][kd][kh][kw][CB] (zero past cout), y [cout, oD, oH, oW]:
 * overwritten by the sum plus bias[co] (unless bias is NULL), through a ReLU where relu is set
 * (epilogue.h); or, when accumulate is set, added to (no bias, no ReLU). geo: kd, kh, kw, sd,
 * sh, dd, dh, dw. */
LAMINA_CLONES static void SUFFIXED(direct_conv)(const REAL *xp, long cin, long Dp, long Hp, long Wp, const REAL *wp,
                                                long cout, const long *geo, REAL *y, long oD, long oH, long oW,
                                                const REAL *bias, int relu, int accumulate) {
    const long NW = 2 * LANES, CB = LAMINA_CO_BLOCK;
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], dd = geo[5], dh = geo[6], dw = geo[7];
    const long per_block = cin * kd * kh * kw * CB;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++)
            for (long cb = 0; cb < cout; cb += CB) {
                const REAL *wblk = wp + (cb / CB) * per_block;
                long nco = cout - cb < CB ? cout - cb : CB;
                for (long w_tile = 0; w_tile < oW; w_tile += NW) {
                    /* A row's last tile, when partial, moves back to end where the row ends (if the
                     * row holds a whole tile and y is overwritten): whole-vector stores, the
                     * overlapped outputs written again with the same values. */
                    const long w0 = w_tile + NW > oW && oW >= NW && !accumulate ? oW - NW : w_tile;
                    VEC lo[LAMINA_CO_BLOCK], hi[LAMINA_CO_BLOCK];
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

/* The weight gradient of the same convolution for one sample, added into dw [cout][cin][kd][kh][kw]
 * (one group): dw[co, ci, a, b, e] += sum over outputs of dy[co, o] · xp[ci, window(o) + tap].
 * Tiles of 3 output channels x kw taps (kw <= LAMINA_DW_MAX_KW = 3: nine sums, three input vectors
 * and a gradient vector stay in the sixteen vector registers; with 4 channels one sum spilled to
 * the stack every iteration) hold vector partial sums over
 * adjacent widths; the outputs are walked one output plane at a time for every (channel block,
 * ci, a, b), the tiles' partial sums living in `partials` between planes (ceil(cout / CB) · cin · kd · kh
 * · CB · kw vectors, zeroed here) and summed into dw at the end. dy rows are read as widths
 * [0, oW) padded by the caller to whole vectors (dyp [cout][oD][oH][oWp], zeros past oW). */
LAMINA_CLONES static void SUFFIXED(direct_conv_dw)(const REAL *xp, long cin, long Dp, long Hp, long Wp,
                                                   const REAL *dyp, long cout, long oD, long oH, long oWp,
                                                   const long *geo, REAL *partials, REAL *dw) {
    const long CB = LAMINA_DW_CO_BLOCK;
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], dd = geo[5], dh = geo[6], dw_ = geo[7];
    const long blocks = (cout + CB - 1) / CB, per_tile = CB * kw;
    const long tiles = blocks * cin * kd * kh;
    memset(partials, 0, sizeof(VEC) * tiles * per_tile);  /* tiles · per_tile vectors */
    for (long od = 0; od < oD; od++) {
        REAL *part = partials;
        for (long cb = 0; cb < blocks; cb++) {
            const REAL *dyr[LAMINA_DW_CO_BLOCK];
            for (long i = 0; i < CB; i++) {
                long co = cb * CB + i < cout ? cb * CB + i : cout - 1;  /* past cout: not stored */
                dyr[i] = dyp + (co * oD + od) * oH * oWp;
            }
            for (long ci = 0; ci < cin; ci++)
                for (long a = 0; a < kd; a++)
                    for (long b = 0; b < kh; b++, part += per_tile * LANES) {
                        VEC acc[LAMINA_DW_CO_BLOCK][LAMINA_DW_MAX_KW];
                        for (long i = 0; i < CB; i++)
                            for (long e = 0; e < LAMINA_DW_MAX_KW; e++)
                                if (e < kw) memcpy(&acc[i][e], part + (i * kw + e) * LANES, sizeof(VEC));
                        /* every row of this output plane before the sums go back to memory */
                        for (long oh = 0; oh < oH; oh++) {
                            const REAL *xr = xp + ((ci * Dp + od * sd + a * dd) * Hp + oh * sh + b * dh) * Wp;
                            for (long w0 = 0; w0 < oWp; w0 += LANES) {
                                VEC xs[LAMINA_DW_MAX_KW], g;
                                for (long e = 0; e < LAMINA_DW_MAX_KW; e++)
                                    if (e < kw) memcpy(&xs[e], xr + w0 + e * dw_, sizeof xs[e]);
                                for (long i = 0; i < CB; i++) {
                                    memcpy(&g, dyr[i] + oh * oWp + w0, sizeof g);
                                    for (long e = 0; e < LAMINA_DW_MAX_KW; e++)
                                        if (e < kw) acc[i][e] += g * xs[e];
                                }
                            }
                        }
                        for (long i = 0; i < CB; i++)
                            for (long e = 0; e < LAMINA_DW_MAX_KW; e++)
                                if (e < kw) memcpy(part + (i * kw + e) * LANES, &acc[i][e], sizeof(VEC));
                    }
        }
    }
    const REAL *part = partials;
    for (long cb = 0; cb < blocks; cb++)
        for (long ci = 0; ci < cin; ci++)
            for (long a = 0; a < kd; a++)
                for (long b = 0; b < kh; b++, part += per_tile * LANES)
                    for (long i = 0; i < CB && cb * CB + i < cout; i++)
                        for (long e = 0; e < kw; e++) {
                            REAL sum = 0;
                            for (long l = 0; l < LANES; l++) sum += part[(i * kw + e) * LANES + l];
                            dw[((((cb * CB + i) * cin + ci) * kd + a) * kh + b) * kw + e] += sum;
                        }
}
