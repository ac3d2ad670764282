/* The weight gradient of direct_conv.h's convolution for one sample, in REAL with vectors VEC of
 * LANES widths (instantiated by direct_conv.h), added into dw [cout][cin][kd][kh][kw] (one group):
 * dw[co, ci, a, b, e] += sum over outputs of dy[co, o] · xp[ci, window(o) + tap].
 * Tiles of LAMINA_DW_CO_BLOCK output channels x kw taps (kw <= LAMINA_DW_MAX_KW = 3) hold vector
 * partial sums over adjacent widths; the outputs are walked one output plane at a time for every
 * (channel block, ci, a, b), the tiles' partial sums living in `partials` between planes
 * (ceil(cout / CB) · cin · kd · kh · CB · kw vectors, zeroed here) and summed into dw at the end.
 * dy rows are read as widths [0, oW) padded by the caller to whole vectors (dyp [cout][oD][oH][oWp],
 * zeros past oW). */
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

