/* The direct convolution for the REAL type direct_conv.h sets. One group: xp [cin, Dp, Hp, Wp]
 * (padded), wp [ceil(cout / CB)][cin][kd][kh][kw][CB] (zero past cout), y [cout, oD, oH, oW]
 * (overwritten). geo: kd, kh, kw, sd, sh, dd, dh, dw. */
LAMINA_CLONES static void SUFFIXED(direct_conv)(const REAL *xp, long cin, long Dp, long Hp, long Wp, const REAL *wp,
                                                long cout, const long *geo, REAL *y, long oD, long oH, long oW) {
    const long NW = 2 * LANES, CB = LAMINA_CO_BLOCK;
    const long kd = geo[0], kh = geo[1], kw = geo[2], sd = geo[3], sh = geo[4], dd = geo[5], dh = geo[6], dw = geo[7];
    const long per_block = cin * kd * kh * kw * CB;
    for (long od = 0; od < oD; od++)
        for (long oh = 0; oh < oH; oh++)
            for (long cb = 0; cb < cout; cb += CB) {
                const REAL *wblk = wp + (cb / CB) * per_block;
                long nco = cout - cb < CB ? cout - cb : CB;
                for (long w0 = 0; w0 < oW; w0 += NW) {
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
                    for (long i = 0; i < CB; i++) {
                        if (i >= nco)
                            break;
                        REAL *yr = y + (((cb + i) * oD + od) * oH + oh) * oW + w0;
                        if (n == NW) {
                            memcpy(yr, &lo[i], sizeof lo[i]);
                            memcpy(yr + LANES, &hi[i], sizeof hi[i]);
                        } else {
                            REAL t[2 * LANES];
                            memcpy(t, &lo[i], sizeof lo[i]);
                            memcpy(t + LANES, &hi[i], sizeof hi[i]);
                            memcpy(yr, t, sizeof(REAL) * n);
                        }
                    }
                }
            }
}
