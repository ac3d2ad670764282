/* Winograd F(2, 3) transforms for the REAL type winograd.h sets. depth3 selects the volume form
 * (4 points along depth) over the image form (depth kernel 1: a tile spans one depth slice). */

static inline __attribute__((always_inline)) VEC SUFFIXED(wino_load)(const REAL *p) {
    VEC v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* Bᵀ along one axis: four vectors at stride s, in place. */
static inline __attribute__((always_inline)) void SUFFIXED(wino_in1)(VEC *v, long s) {
    VEC d0 = v[0], d1 = v[s], d2 = v[2 * s], d3 = v[3 * s];
    v[0] = d0 - d2;
    v[s] = d1 + d2;
    v[2 * s] = d2 - d1;
    v[3 * s] = d1 - d3;
}

/* V[tl][ξ][c0..) (tiles lamina_wino_tile_stride apart) for tiles [t0, t1) of a grid TD x TH x TW (tl = t - t0). Inlined into
 * wino_input once per constant depth3, so that the loops over the transform's points unroll and
 * its vectors stay in registers. */
static inline __attribute__((always_inline)) void SUFFIXED(wino_input_form)(const REAL *xcl, long Cp, long Hp,
                                                                            long Wp, const int depth3, long TH,
                                                                            long TW, long t0, long t1, REAL *V) {
    const long A = depth3 ? 4 : 1, XI = 16 * A, VS = lamina_wino_tile_stride(XI, Cp, sizeof(REAL));
    VEC buf[64];
    for (long t = t0; t < t1; t++) {
        long tw = t % TW, th = (t / TW) % TH, td = t / (TW * TH);
        long d0 = depth3 ? 2 * td : td, h0 = 2 * th, w0 = 2 * tw;
        for (long c0 = 0; c0 < Cp; c0 += LANES) {
            for (long a = 0; a < A; a++)
                for (long b = 0; b < 4; b++) {  /* widths, as the row is read */
                    const REAL *row = xcl + (((d0 + a) * Hp + h0 + b) * Wp + w0) * Cp + c0;
                    VEC x0 = SUFFIXED(wino_load)(row), x1 = SUFFIXED(wino_load)(row + Cp);
                    VEC x2 = SUFFIXED(wino_load)(row + 2 * Cp), x3 = SUFFIXED(wino_load)(row + 3 * Cp);
                    VEC *v = buf + (a * 4 + b) * 4;
                    v[0] = x0 - x2;
                    v[1] = x1 + x2;
                    v[2] = x2 - x1;
                    v[3] = x1 - x3;
                }
            for (long a = 0; a < A; a++)
                for (long e = 0; e < 4; e++) SUFFIXED(wino_in1)(buf + a * 16 + e, 4);   /* heights */
            if (depth3)
                for (long be = 0; be < 16; be++) SUFFIXED(wino_in1)(buf + be, 16);     /* depths */
            for (long xi = 0; xi < XI; xi++)
                memcpy(V + (t - t0) * VS + xi * Cp + c0, &buf[xi], sizeof(VEC));
        }
    }
}

LAMINA_CLONES static void SUFFIXED(wino_input)(const REAL *xcl, long Cp, long Hp, long Wp, int depth3, long TH,
                                               long TW, long t0, long t1, REAL *V) {
    if (depth3)
        SUFFIXED(wino_input_form)(xcl, Cp, Hp, Wp, 1, TH, TW, t0, t1, V);
    else
        SUFFIXED(wino_input_form)(xcl, Cp, Hp, Wp, 0, TH, TW, t0, t1, V);
}

/* Aᵀ along one axis: four vectors at stride s in, two at stride s out (in place). */
static inline __attribute__((always_inline)) void SUFFIXED(wino_out1)(VEC *v, long s) {
    VEC m0 = v[0], m1 = v[s], m2 = v[2 * s], m3 = v[3 * s];
    v[0] = m0 + m1 + m2;
    v[s] = m1 - m2 - m3;
}

/* lanes 0..LANES/2-1 and LANES/2.. of w0 and w1 interleaved: (w0[l], w1[l]) pairs in order */
#if LANES == 8
#define WINO_PAIRS_LOW {0, 8, 1, 9, 2, 10, 3, 11}
#define WINO_PAIRS_HIGH {4, 12, 5, 13, 6, 14, 7, 15}
#else
#define WINO_PAIRS_LOW {0, 4, 1, 5}
#define WINO_PAIRS_HIGH {2, 6, 3, 7}
#endif

/* The output rows of one row of tiles, from their staging [cout][OA][2][RW] (wino_output_form's
 * rows), to y [cout][oD][oH][oW] at (od0, oh0): those inside y. */
static inline void SUFFIXED(wino_flush_row)(const REAL *rows, long RW, long OA, long cout, REAL *y, long oD,
                                            long oH, long oW, long od0, long oh0) {
    for (long co = 0; co < cout; co++)
        for (long a = 0; a < OA && od0 + a < oD; a++)
            for (long b = 0; b < 2 && oh0 + b < oH; b++)
                memcpy(y + ((co * oD + od0 + a) * oH + oh0 + b) * oW, rows + ((co * OA + a) * 2 + b) * RW,
                       oW * sizeof(REAL));
}

/* y[co, od, oh, ow] = the outputs of tiles [t0, t1) from M[tl][ξ][co] (tiles
 * lamina_wino_tile_stride apart), plus bias[co] (unless bias
 * is NULL), through a ReLU where relu is set (epilogue.h); or, when accumulate is set, added to y
 * (no bias, no ReLU). y [cout][oD][oH][oW]. With pool set, y is instead the max pool of kernel 2
 * and stride 2 (along height and width, and depth when depth3) of those outputs, [cout][pD][pH][pW]
 * with pD = oD / 2 (depth3) or oD, pH = oH / 2, pW = oW / 2: the pool's windows are the tiles, so
 * each tile stores its maximum, taken in the pool's order (depth, height, width), and a tile
 * cut by the output's end stores nothing (the pool rounds down). The bias and the ReLU apply to
 * the maximum, as in direct_conv_pooled (neither reorders values: the same result, bit for bit).
 * Inlined into wino_output once per constant depth3 and pool (as wino_input_form).
 * Where `rows` is given (overwriting y, not pooled), a tile row's outputs go there first,
 * [COp][OA][2][2·TW] (wino_flush_row), and on to y as whole output rows once the row's last tile
 * is done: each tile's pairs of widths, stored straight to y, touched a cache line per channel
 * and output row of the tile, and its stores took a fifth of conv case D's forward. */
static inline __attribute__((always_inline)) void SUFFIXED(wino_output_form)(
    const REAL *M, long COp, long cout, const int depth3, long TH, long TW, long t0, long t1, REAL *y, long oD,
    long oH, long oW, const REAL *bias, int relu, int accumulate, const int pool, REAL *rows) {
    const long A = depth3 ? 4 : 1, XI = 16 * A, OA = depth3 ? 2 : 1, RW = 2 * TW;
    const long MS = lamina_wino_tile_stride(XI, COp, sizeof(REAL));
    const long pD = depth3 ? oD / 2 : oD, pH = oH / 2, pW = oW / 2;
    VEC buf[64];
    VEC biases[COp / LANES];  /* the bias by vectors of channels, zero past cout */
    if (bias && !accumulate)
        for (long co = 0; co < COp; co++) biases[co / LANES][co % LANES] = co < cout ? bias[co] : 0;
    for (long t = t0; t < t1; t++) {
        long tw = t % TW, th = (t / TW) % TH, td = t / (TW * TH);
        long od0 = depth3 ? 2 * td : td, oh0 = 2 * th, ow0 = 2 * tw;
        if (pool && (td >= pD || th >= pH || tw >= pW))
            continue;
        for (long co0 = 0; co0 < COp; co0 += LANES) {
            const REAL *mt = M + (t - t0) * MS + co0;
            for (long ab = 0; ab < A * 4; ab++) {  /* widths, as M is read */
                VEC m0 = SUFFIXED(wino_load)(mt + (ab * 4) * COp), m1 = SUFFIXED(wino_load)(mt + (ab * 4 + 1) * COp);
                VEC m2 = SUFFIXED(wino_load)(mt + (ab * 4 + 2) * COp), m3 = SUFFIXED(wino_load)(mt + (ab * 4 + 3) * COp);
                buf[ab * 4] = m0 + m1 + m2;
                buf[ab * 4 + 1] = m1 - m2 - m3;
            }
            for (long a = 0; a < A; a++)
                for (long e = 0; e < 2; e++) SUFFIXED(wino_out1)(buf + a * 16 + e, 4);
            if (depth3)
                for (long b = 0; b < 2; b++)
                    for (long e = 0; e < 2; e++) SUFFIXED(wino_out1)(buf + b * 4 + e, 16);
            const long lanes = cout - co0 < LANES ? cout - co0 : LANES, plane = oD * oH * oW;
            if (pool) {
                VEC best = buf[0];
                for (long a = 0; a < OA; a++)
                    for (long b = 0; b < 2; b++)
                        for (long e = 0; e < 2; e++) best = SUFFIXED(pool_max)(best, buf[(a * 4 + b) * 4 + e]);
                if (bias)
                    best += biases[co0 / LANES];
                if (relu)
                    best = SUFFIXED(relu)(best);
                REAL v[LANES];
                memcpy(v, &best, sizeof v);
                REAL *yp = y + ((co0 * pD + td) * pH + th) * pW + tw;
                for (long l = 0; l < lanes; l++) yp[l * pD * pH * pW] = v[l];
                continue;
            }
            for (long a = 0; a < OA; a++)
                for (long b = 0; b < 2; b++) {
                    long od = od0 + a, oh = oh0 + b;
                    if (od >= oD || oh >= oH) continue;
                    VEC w0 = buf[(a * 4 + b) * 4], w1 = buf[(a * 4 + b) * 4 + 1];
                    if (bias && !accumulate) {
                        w0 += biases[co0 / LANES];
                        w1 += biases[co0 / LANES];
                    }
                    if (relu && !accumulate) {
                        w0 = SUFFIXED(relu)(w0);
                        w1 = SUFFIXED(relu)(w1);
                    }
                    REAL v0[LANES], v1[LANES];  /* widths ow0 and ow0 + 1 of each lane's channel */
                    memcpy(v0, &w0, sizeof v0);
                    memcpy(v1, &w1, sizeof v1);
                    REAL *yp = y + ((co0 * oD + od) * oH + oh) * oW + ow0;
                    if (!accumulate && (rows || ow0 + 1 < oW)) {  /* each channel's two widths as one pair */
                        REAL pairs[2 * LANES];
                        VEC first = __builtin_shuffle(w0, w1, (IVEC)WINO_PAIRS_LOW);
                        VEC second = __builtin_shuffle(w0, w1, (IVEC)WINO_PAIRS_HIGH);
                        memcpy(pairs, &first, sizeof first);
                        memcpy(pairs + LANES, &second, sizeof second);
                        REAL *to = rows ? rows + ((co0 * OA + a) * 2 + b) * RW + ow0 : yp;
                        const long step = rows ? OA * 2 * RW : plane;  /* from one channel to the next */
                        for (long l = 0; l < lanes; l++) memcpy(to + l * step, pairs + 2 * l, 2 * sizeof(REAL));
                    } else if (ow0 + 1 < oW) {
                        for (long l = 0; l < lanes; l++) {
                            yp[l * plane] += v0[l];
                            yp[l * plane + 1] += v1[l];
                        }
                    } else {
                        for (long l = 0; l < lanes; l++) yp[l * plane] = accumulate ? yp[l * plane] + v0[l] : v0[l];
                    }
                }
        }
        if (rows && tw == TW - 1)
            SUFFIXED(wino_flush_row)(rows, RW, OA, cout, y, oD, oH, oW, od0, oh0);
    }
}

LAMINA_CLONES static void SUFFIXED(wino_output)(const REAL *M, long COp, long cout, int depth3, long TH, long TW,
                                                long t0, long t1, REAL *y, long oD, long oH, long oW,
                                                const REAL *bias, int relu, int accumulate, int pool, REAL *rows) {
#define WINO_OUTPUT_FORM(d3, pl) \
    SUFFIXED(wino_output_form)(M, COp, cout, d3, TH, TW, t0, t1, y, oD, oH, oW, bias, relu, accumulate, pl, rows)
    if (depth3)
        pool ? WINO_OUTPUT_FORM(1, 1) : WINO_OUTPUT_FORM(1, 0);
    else
        pool ? WINO_OUTPUT_FORM(0, 1) : WINO_OUTPUT_FORM(0, 0);
#undef WINO_OUTPUT_FORM
}

/* Lines [l0, l1) of xcl [Dp][Hp][Wp][Cp] (line l: dd = l / Hp, hh = l % Hp) = one sample x
 * [C][D][H][W] channels-last at (pd, ph, pw), zero elsewhere (the padding, and channels C..Cp):
 * whole lines outside x and each line's ends are cleared, the rest written once, in order. */
LAMINA_CLONES static void SUFFIXED(wino_pad_input)(const REAL *x, long C, long D, long H, long W, long pd, long ph,
                                                   long pw, long Cp, long Hp, long Wp, long l0, long l1, REAL *xcl) {
    for (long l = l0; l < l1; l++) {
        const long dd = l / Hp, hh = l % Hp;
        REAL *line = xcl + l * Wp * Cp;
        const long d = dd - pd, h = hh - ph;
        if (d < 0 || d >= D || h < 0 || h >= H) {
            memset(line, 0, Wp * Cp * sizeof(REAL));
            continue;
        }
        memset(line, 0, pw * Cp * sizeof(REAL));
        memset(line + (pw + W) * Cp, 0, (Wp - pw - W) * Cp * sizeof(REAL));
        if (Cp > C)
            for (long w = 0; w < W; w++) memset(line + (pw + w) * Cp + C, 0, (Cp - C) * sizeof(REAL));
        const REAL *src = x + (d * H + h) * W;  /* channel c's row at src + c·D·H·W */
        const long plane = D * H * W;
        long c0 = 0;
        for (; c0 + LANES <= C; c0 += LANES) {  /* blocks of LANES channels x LANES widths */
            long w = 0;
            for (; w + LANES <= W; w += LANES)
                SUFFIXED(transpose_block)(src + c0 * plane + w, plane, line + (pw + w) * Cp + c0, Cp);
            for (; w < W; w++)
                for (long i = 0; i < LANES; i++) line[(pw + w) * Cp + c0 + i] = src[(c0 + i) * plane + w];
        }
        for (; c0 < C; c0++)
            for (long w = 0; w < W; w++) line[(pw + w) * Cp + c0] = src[c0 * plane + w];
    }
}

/* The convolution of the tile rows [r0, r1) of one sample (row r: the TW tiles from r·TW, a
 * grid TD x TH x TW of them) from its channels-last padded copy: tiles in blocks of T, each
 * block's transforms and XI panel GEMMs (packed: XI · panel_count(COp) panels of Cp rows); y as
 * wino_output's, by way of a tile row's staging where y is overwritten and not pooled (and the
 * staging's allocation succeeds). */
static void SUFFIXED(wino_conv)(const REAL *xcl, long Cp, long Hp, long Wp, int depth3, long TH, long TW, long r0,
                                long r1, const REAL *packed, long COp, long cout, long T, REAL *V, REAL *M, REAL *y,
                                long oD, long oH, long oW, const REAL *bias, int relu, int accumulate, int pool) {
    const long XI = depth3 ? 64 : 16, tiles = r1 * TW;
    const long panels = SUFFIXED(panel_count)(COp), per_xi = panels * Cp * 2 * LANES;
    const long VS = lamina_wino_tile_stride(XI, Cp, sizeof(REAL)), MS = lamina_wino_tile_stride(XI, COp, sizeof(REAL));
    REAL *rows = accumulate || pool ? NULL : malloc(COp * (depth3 ? 2 : 1) * 2 * 2 * TW * sizeof(REAL));
    for (long t0 = r0 * TW; t0 < tiles; t0 += T) {
        long t1 = t0 + T < tiles ? t0 + T : tiles, n = t1 - t0;
        SUFFIXED(wino_input)(xcl, Cp, Hp, Wp, depth3, TH, TW, t0, t1, V);
        for (long xi = 0; xi < XI; xi++)
            SUFFIXED(panel_gemm)(n, Cp, COp, V + xi * Cp, VS, packed + xi * per_xi, 0, panels, M + xi * COp, MS, 0);
        SUFFIXED(wino_output)(M, COp, cout, depth3, TH, TW, t0, t1, y, oD, oH, oW, bias, relu, accumulate, pool,
                              rows);
    }
    free(rows);
}

#undef WINO_PAIRS_LOW
#undef WINO_PAIRS_HIGH

/* A member of a team running winograd.h's lamina_wino_batch: with split unset, runs of whole
 * samples (lamina_claim_run), each padded into the member's own xcl; with split set (a batch
 * smaller than the team), every member on each sample in turn: runs of its padded copy's lines
 * into the one xcl (xcl[0]), then, once every line is in place, runs of its rows of tiles. The
 * counters are monotonic over the batch (pad_next and padded: item n·lines + l is sample n's
 * line l; next and rows_done: n·R + r its tile row r), so no member waits for another to arrive:
 * a member woken late finds the work done and takes none of it. */
static void SUFFIXED(wino_batch_member)(void *job, int t, int nt) {
    lamina_wino_batch *j = job;
    REAL *V = j->V[t], *M = j->M[t];
    const long R = j->TD * j->TH, lines = j->Dp * j->Hp;
#define WINO_SAMPLE_ROWS(xcl, n, r0, r1) \
    SUFFIXED(wino_conv)(xcl, j->Cp, j->Hp, j->Wp, j->depth3, j->TH, j->TW, r0, r1, j->packed, j->COp, j->cout, j->T, \
                        V, M, (REAL *)j->y + (n) * j->y_stride, j->oD, j->oH, j->oW, j->bias, j->relu, j->accumulate, \
                        j->pool)
#define WINO_PAD(xcl, n, l0, l1) \
    SUFFIXED(wino_pad_input)((const REAL *)j->x + (n) * j->x_stride, j->C, j->D, j->H, j->W, j->pd, j->ph, j->pw, \
                             j->Cp, j->Hp, j->Wp, l0, l1, xcl)
    if (!j->split) {
        REAL *xcl = j->xcl[t];
        for (long n, end = 0; (n = lamina_claim_run(&j->next, j->N, nt, &end)) < j->N;)
            for (; n < end; n++) {
                WINO_PAD(xcl, n, 0, lines);
                WINO_SAMPLE_ROWS(xcl, n, 0, R);
            }
        return;
    }
    REAL *xcl = j->xcl[0];
    const double spin = lamina_team.spin;
    for (long n = 0; n < j->N; n++) {
        lamina_team_wait(&j->rows_done, n * R, spin, NULL);  /* the previous sample's copy is read */
        for (long l, end = 0; (l = lamina_claim_run(&j->pad_next, (n + 1) * lines, nt, &end)) < (n + 1) * lines;) {
            WINO_PAD(xcl, n, l - n * lines, end - n * lines);
            lamina_team_add(&j->padded, end - l);
        }
        lamina_team_wait(&j->padded, (n + 1) * lines, spin, NULL);
        for (long r, end = 0; (r = lamina_claim_run(&j->next, (n + 1) * R, nt, &end)) < (n + 1) * R;) {
            WINO_SAMPLE_ROWS(xcl, n, r - n * R, end - n * R);
            lamina_team_add(&j->rows_done, end - r);
        }
    }
#undef WINO_SAMPLE_ROWS
#undef WINO_PAD
}
