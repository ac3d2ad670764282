/* The fused recurrence for the REAL type recurrence.h sets (see there). */

LAMINA_CLONES static void SUFFIXED(rnn_activate)(int kind, long n, REAL *restrict g, const REAL *restrict bias,
                                                 REAL *restrict h) {
    if (bias)
        for (long j = 0; j < n; j++) g[j] += bias[j];
    if (kind == LAMINA_RNN_RELU)
        for (long j = 0; j < n; j++) h[j] = g[j] < 0 ? 0 : g[j]; /* NaN stays NaN */
    else
        for (long j = 0; j < n; j++) h[j] = TANH(g[j]);
}

LAMINA_CLONES static void SUFFIXED(rnn_activate_backward)(int kind, long n, const REAL *restrict h,
                                                          const REAL *restrict dh, REAL *restrict dg) {
    if (kind == LAMINA_RNN_RELU)
        for (long j = 0; j < n; j++) dg[j] = h[j] > 0 ? dh[j] : 0;
    else
        for (long j = 0; j < n; j++) dg[j] = dh[j] * (1 - h[j] * h[j]);
}

/* c[rows of the share] (+)= a[the same rows] · P for the share's units of each of `blocks`
 * column blocks of H (the gates; 1 for dh_prev): rows first, first + stride, ... of a and c. */
static void SUFFIXED(share_product)(const lamina_share *sh, long b, long k, long H, long blocks, const REAL *a,
                                    long lda, const REAL *packed, REAL *c, long ldc, REAL beta) {
    const long NR = 2 * LANES, m = lamina_share_rows(sh, b);
    if (m == 0 || sh->width == 0)
        return;
    a += sh->first * lda;
    c += sh->first * ldc;
    if (sh->width == H)  /* every unit: one pass over all panels (H need not be whole panels) */
        SUFFIXED(panel_gemm)(m, k, blocks * H, a, sh->stride * lda, packed, 0, (blocks * H + NR - 1) / NR,
                             c, sh->stride * ldc, beta);
    else
        for (long q = 0; q < blocks; q++)
            SUFFIXED(panel_gemm)(m, k, blocks * H, a, lda, packed, (q * H + sh->u0) / NR,
                                 (q * H + sh->u0 + sh->width) / NR, c, ldc, beta);
}

/* The rows of `all` [total, H] holding the previous states of step s's rows (the first rows of
 * step s - 1), or `initial` for step 0; NULL where `all` is. */
static inline const REAL *SUFFIXED(previous)(long s, const long *starts, long H, const REAL *all,
                                             const REAL *initial) {
    return s ? (all ? all + starts[s - 1] * H : NULL) : initial;
}

/* kind: LAMINA_*; G gates; packed: the panels of W_hhᵀ (H x G·H); by_rows: see lamina_share
 * (by units needs H to be whole panels). bias (G·H, or NULL): added to g's rows by the cells,
 * which read them anyway (b_ih + b_hh; for GRU b_ih, b_hh going into hh), instead of a pass of its
 * own over all of g. out (or NULL): each new state also goes to row out_rows[row] of out (row
 * stride ldo; the layer's output in the sequences' own order) while it is in cache, instead of a
 * scatter pass over all of hs afterwards. rd: the product's left operand in a reduced precision
 * (recurrence.h; kind LAMINA_REDUCE_NONE: the states themselves). */
static void SUFFIXED(recurrence_forward)(int kind, long steps, const long *starts, long H, long G, REAL *g,
                                         const REAL *bias, REAL *hh, const REAL *b_hh, const REAL *packed,
                                         REAL *hs, REAL *cs, const REAL *init_h, const REAL *init_c,
                                         REAL *out, long ldo, const int *out_rows, int t, int nt,
                                         lamina_spin_barrier *barrier, int by_rows, const lamina_reduction *rd) {
    const long NR = 2 * LANES, GH = G * H;
    lamina_share sh = lamina_share_of(by_rows, H, NR, t, nt);
    int sense = 0;
    long u0 = sh.u0, width = sh.width;
    const int panels = rd->kind == LAMINA_REDUCE_INT8_PANELS || rd->kind == LAMINA_REDUCE_BF16_PANELS;
    REAL *reduced = rd->kind && !panels ? (REAL *)rd->scratch + t * rd->per_thread : NULL;
    for (long s = 0; s < steps; s++) {
        long r0 = starts[s], b = starts[s + 1] - r0;
        const REAL *prev_h = SUFFIXED(previous)(s, starts, H, hs, init_h);
        const REAL *prev_c = SUFFIXED(previous)(s, starts, H, cs, init_c);
        REAL *prod = kind == LAMINA_GRU ? hh + r0 * GH : g + r0 * GH;  /* GRU keeps it apart */
        if (prev_h && panels)
            SUFFIXED(lamina_panels_share_product)(&sh, b, H, H, G, prev_h, H, rd, t, prod, GH,
                                                  kind == LAMINA_GRU ? 0 : 1);
        else if (prev_h && reduced) {  /* the rows this thread's product reads (by units: all of them) */
            for (long r = sh.first; r < b; r += sh.stride)
                SUFFIXED(lamina_reduce_row)(rd->kind, rd->levels, prev_h + r * H, H, reduced + r * H);
            SUFFIXED(share_product)(&sh, b, H, H, G, reduced, H, packed, prod, GH, kind == LAMINA_GRU ? 0 : 1);
        } else if (prev_h)
            SUFFIXED(share_product)(&sh, b, H, H, G, prev_h, H, packed, prod, GH, kind == LAMINA_GRU ? 0 : 1);
        for (long r = sh.first; r < b && width > 0; r += sh.stride) {
            long row = r0 + r;
            REAL *gr = g + row * GH + u0, *hr = hs + row * H + u0;
            if (kind == LAMINA_GRU)
                for (long k = 0; k < G; k++) {
                    REAL *part = hh + row * GH + k * H + u0;
                    if (!prev_h) memset(part, 0, sizeof(REAL) * width);
                    if (b_hh)
                        for (long j = 0; j < width; j++) part[j] += b_hh[k * H + u0 + j];
                }
            const REAL *br = bias ? bias + u0 : NULL;
            if (kind == LAMINA_LSTM)
                SUFFIXED(lstm_row)(width, H, gr, br, prev_c ? prev_c + r * H + u0 : NULL, cs + row * H + u0, hr);
            else if (kind == LAMINA_GRU)
                SUFFIXED(gru_row)(width, H, gr, br, hh + row * GH + u0, prev_h ? prev_h + r * H + u0 : NULL,
                                  hr);
            else
                SUFFIXED(rnn_activate)(kind, width, gr, br, hr);
            if (out)
                memcpy(out + out_rows[row] * ldo + u0, hr, sizeof(REAL) * width);
        }
        if (!sh.by_rows)
            lamina_spin_wait(barrier, nt, &sense);
    }
}

/* The backward recurrence, steps in reverse, with the forward's shares. Per step: the cell
 * backward of the share (dg, and dgh for GRU: the gradient of the recurrent part; dc_prev and,
 * for GRU, the direct path into dh_prev), then dh_prev += dG · W_hh for the share (packed: the
 * panels of W_hh, G·H x H). By units, a barrier between the two (the product reads every unit
 * of dG); the next step reads only the share's own part of dh_prev and dc_prev, so one barrier
 * per step suffices. dhs/dcs: gradients reaching each row's h (and c) from outside and from later
 * steps; dh0/dc0: the initial states' gradients or NULL (not wanted). rd: dG's rows reduced
 * before the product, as in the forward (recurrence.h). */
static void SUFFIXED(recurrence_backward)(int kind, long steps, const long *starts, long H, long G,
                                          const REAL *g, const REAL *hh, const REAL *hs, const REAL *cs,
                                          REAL *dhs, REAL *dcs, REAL *dg, REAL *dgh, const REAL *packed,
                                          const REAL *init_h, const REAL *init_c, REAL *dh0, REAL *dc0,
                                          int t, int nt, lamina_spin_barrier *barrier, int by_rows,
                                          const lamina_reduction *rd) {
    const long NR = 2 * LANES, GH = G * H;
    lamina_share sh = lamina_share_of(by_rows, H, NR, t, nt);
    int sense = 0;
    long u0 = sh.u0, width = sh.width;
    const int panels = rd->kind == LAMINA_REDUCE_BF16_PANELS;
    REAL *reduced = rd->kind && !panels ? (REAL *)rd->scratch + t * rd->per_thread : NULL;
    for (long s = steps - 1; s >= 0; s--) {
        long r0 = starts[s], b = starts[s + 1] - r0;
        const REAL *prev_h = SUFFIXED(previous)(s, starts, H, hs, init_h);
        const REAL *prev_c = SUFFIXED(previous)(s, starts, H, cs, init_c);
        REAL *dprev_h = s ? dhs + starts[s - 1] * H : (prev_h ? dh0 : NULL);  /* no state, no gradient */
        REAL *dprev_c = (REAL *)SUFFIXED(previous)(s, starts, H, dcs, dc0);
        for (long r = sh.first; r < b && width > 0; r += sh.stride) {
            long row = r0 + r, o = r * H + u0;
            const REAL *gr = g + row * GH + u0;
            REAL *dgr = dg + row * GH + u0;
            if (kind == LAMINA_LSTM)
                SUFFIXED(lstm_row_backward)(width, H, gr, prev_c ? prev_c + o : NULL, cs + row * H + u0,
                                            dhs + row * H + u0, dcs + row * H + u0, dgr,
                                            dprev_c ? dprev_c + o : NULL);
            else if (kind == LAMINA_GRU)
                SUFFIXED(gru_row_backward)(width, H, gr, hh + row * GH + u0, prev_h ? prev_h + o : NULL,
                                           dhs + row * H + u0, dgr, dgh + row * GH + u0,
                                           dprev_h ? dprev_h + o : NULL);
            else
                SUFFIXED(rnn_activate_backward)(kind, width, hs + row * H + u0, dhs + row * H + u0, dgr);
        }
        if (!sh.by_rows)
            lamina_spin_wait(barrier, nt, &sense);
        if (dprev_h && panels)
            SUFFIXED(lamina_panels_share_product)(&sh, b, GH, H, 1, dgh + r0 * GH, GH, rd, t, dprev_h, H, 1);
        else if (dprev_h && reduced) {  /* dh_prev += dG_t W_hh, dG_t's rows that the share reads reduced */
            for (long r = sh.first; r < b; r += sh.stride)
                SUFFIXED(lamina_reduce_row)(rd->kind, rd->levels, dgh + (r0 + r) * GH, GH, reduced + r * GH);
            SUFFIXED(share_product)(&sh, b, GH, H, 1, reduced, GH, packed, dprev_h, H, 1);
        } else if (dprev_h)
            SUFFIXED(share_product)(&sh, b, GH, H, 1, dgh + r0 * GH, GH, packed, dprev_h, H, 1);
    }
}

/* The team runs (team.h): recurrence_forward and recurrence_backward on `threads` threads at
 * once, each member its share, with one barrier. */
typedef struct {
    int kind, by_rows;
    long steps, H, G, ldo;
    const long *starts;
    REAL *g, *hh, *hs, *cs, *out;
    const REAL *bias, *b_hh, *packed, *init_h, *init_c;
    const int *out_rows;
    lamina_spin_barrier barrier;
    lamina_reduction reduction;
} SUFFIXED(recurrence_forward_job);

static void SUFFIXED(recurrence_forward_member)(void *job, int t, int nt) {
    SUFFIXED(recurrence_forward_job) *j = job;
    SUFFIXED(recurrence_forward)(j->kind, j->steps, j->starts, j->H, j->G, j->g, j->bias, j->hh, j->b_hh, j->packed,
                                 j->hs, j->cs, j->init_h, j->init_c, j->out, j->ldo, j->out_rows, t, nt, &j->barrier,
                                 j->by_rows, &j->reduction);
}

static void SUFFIXED(recurrence_forward_team)(int kind, long steps, const long *starts, long H, long G, REAL *g,
                                              const REAL *bias, REAL *hh, const REAL *b_hh, const REAL *packed,
                                              REAL *hs, REAL *cs, const REAL *init_h, const REAL *init_c,
                                              REAL *out, long ldo, const int *out_rows, int threads, int by_rows,
                                              lamina_reduction reduction) {
    SUFFIXED(recurrence_forward_job) job = {kind, by_rows, steps, H, G, ldo, starts, g, hh, hs, cs, out, bias, b_hh,
                                            packed, init_h, init_c, out_rows, {0, 0}, reduction};
    lamina_team_run(threads, SUFFIXED(recurrence_forward_member), &job);
}

typedef struct {
    int kind, by_rows;
    long steps, H, G;
    const long *starts;
    const REAL *g, *hh, *hs, *cs, *packed, *init_h, *init_c;
    REAL *dhs, *dcs, *dg, *dgh, *dh0, *dc0;
    lamina_spin_barrier barrier;
    lamina_reduction reduction;
} SUFFIXED(recurrence_backward_job);

static void SUFFIXED(recurrence_backward_member)(void *job, int t, int nt) {
    SUFFIXED(recurrence_backward_job) *j = job;
    SUFFIXED(recurrence_backward)(j->kind, j->steps, j->starts, j->H, j->G, j->g, j->hh, j->hs, j->cs, j->dhs, j->dcs,
                                  j->dg, j->dgh, j->packed, j->init_h, j->init_c, j->dh0, j->dc0, t, nt, &j->barrier,
                                  j->by_rows, &j->reduction);
}

static void SUFFIXED(recurrence_backward_team)(int kind, long steps, const long *starts, long H, long G,
                                               const REAL *g, const REAL *hh, const REAL *hs, const REAL *cs,
                                               REAL *dhs, REAL *dcs, REAL *dg, REAL *dgh, const REAL *packed,
                                               const REAL *init_h, const REAL *init_c, REAL *dh0, REAL *dc0,
                                               int threads, int by_rows, lamina_reduction reduction) {
    SUFFIXED(recurrence_backward_job) job = {kind, by_rows, steps, H, G, starts, g, hh, hs, cs, packed, init_h,
                                             init_c, dhs, dcs, dg, dgh, dh0, dc0, {0, 0}, reduction};
    lamina_team_run(threads, SUFFIXED(recurrence_backward_member), &job);
}
