/* The fused forward recurrence for the REAL type recurrence.h sets (see there). */

LAMINA_CLONES static void SUFFIXED(rnn_activate)(int kind, long n, const REAL *restrict g, REAL *restrict h) {
    if (kind == LAMINA_RNN_RELU)
        for (long j = 0; j < n; j++) h[j] = g[j] > 0 ? g[j] : 0;
    else
        for (long j = 0; j < n; j++) h[j] = TANH(g[j]);
}

/* kind: LAMINA_*; G gates; H a multiple of 2·LANES; packed: the panels of W_hhᵀ (H x G·H). */
static void SUFFIXED(recurrence_forward)(int kind, long steps, const long *starts, long H, long G, REAL *g,
                                         REAL *hh, const REAL *b_hh, const REAL *packed, REAL *hs, REAL *cs,
                                         const REAL *init_h, const REAL *init_c, int threads) {
    const long NR = 2 * LANES, GH = G * H, unit_panels = H / NR;
    lamina_spin_barrier barrier = {0, 0};
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), sense = 0;
        long q0, q1;
        lamina_unit_block(unit_panels, &q0, &q1);
        long u0 = q0 * NR, width = (q1 - q0) * NR;
        for (long s = 0; s < steps; s++) {
            long r0 = starts[s], b = starts[s + 1] - r0;
            const REAL *prev_h = s ? hs + starts[s - 1] * H : init_h;
            const REAL *prev_c = s ? (cs ? cs + starts[s - 1] * H : NULL) : init_c;
            if (width > 0) {
                /* the recurrent product for this thread's units of every gate */
                REAL *prod = kind == LAMINA_GRU ? hh + r0 * GH : g + r0 * GH;
                for (long k = 0; k < G; k++) {
                    if (prev_h)
                        SUFFIXED(panel_gemm)(b, H, GH, prev_h, H, packed, k * unit_panels + q0, k * unit_panels + q1,
                                             prod, GH, kind == LAMINA_GRU ? 0 : 1);
                    if (kind == LAMINA_GRU)
                        for (long r = 0; r < b; r++) {
                            REAL *row = prod + r * GH + k * H + u0;
                            if (!prev_h) memset(row, 0, sizeof(REAL) * width);
                            if (b_hh)
                                for (long j = 0; j < width; j++) row[j] += b_hh[k * H + u0 + j];
                        }
                }
                for (long r = 0; r < b; r++) {
                    long row = r0 + r;
                    REAL *gr = g + row * GH + u0, *hr = hs + row * H + u0;
                    if (kind == LAMINA_LSTM)
                        SUFFIXED(lstm_row)(width, H, gr, prev_c ? prev_c + r * H + u0 : NULL, cs + row * H + u0, hr);
                    else if (kind == LAMINA_GRU)
                        SUFFIXED(gru_row)(width, H, gr, hh + row * GH + u0, prev_h ? prev_h + r * H + u0 : NULL, hr);
                    else
                        SUFFIXED(rnn_activate)(kind, width, gr, hr);
                }
            }
            lamina_spin_wait(&barrier, nt, &sense);
        }
    }
}

LAMINA_CLONES static void SUFFIXED(rnn_activate_backward)(int kind, long n, const REAL *restrict h,
                                                          const REAL *restrict dh, REAL *restrict dg) {
    if (kind == LAMINA_RNN_RELU)
        for (long j = 0; j < n; j++) dg[j] = h[j] > 0 ? dh[j] : 0;
    else
        for (long j = 0; j < n; j++) dg[j] = dh[j] * (1 - h[j] * h[j]);
}

/* The backward recurrence, steps in reverse, threads owning the same blocks of units as forward.
 * Per step: the cell backward of this thread's units (dg, and dgh for GRU: the gradient of the
 * recurrent part; dc_prev and, for GRU, the direct path into dh_prev, of its units), a barrier,
 * then dh_prev[:, its units] += dG · W_hh[:, its units] over all gates (packed: panels of W_hh,
 * G·H x H). The next step reads only this thread's own units of dh_prev and dc_prev, so one
 * barrier per step suffices. dhs/dcs: gradients reaching each row's h (and c) from outside and
 * from later steps; dh0/dc0: the initial states' gradients or NULL (not wanted). */
static void SUFFIXED(recurrence_backward)(int kind, long steps, const long *starts, long H, long G,
                                          const REAL *g, const REAL *hh, const REAL *hs, const REAL *cs,
                                          REAL *dhs, REAL *dcs, REAL *dg, REAL *dgh, const REAL *packed,
                                          const REAL *init_h, const REAL *init_c, REAL *dh0, REAL *dc0,
                                          int threads) {
    const long NR = 2 * LANES, GH = G * H, unit_panels = H / NR;
    lamina_spin_barrier barrier = {0, 0};
    #pragma omp parallel num_threads(threads)
    {
        int nt = omp_get_num_threads(), sense = 0;
        long q0, q1;
        lamina_unit_block(unit_panels, &q0, &q1);
        long u0 = q0 * NR, width = (q1 - q0) * NR;
        for (long s = steps - 1; s >= 0; s--) {
            long r0 = starts[s], b = starts[s + 1] - r0;
            const REAL *prev_h = s ? hs + starts[s - 1] * H : init_h;
            const REAL *prev_c = s ? (cs ? cs + starts[s - 1] * H : NULL) : init_c;
            REAL *dprev_h = s ? dhs + starts[s - 1] * H : (prev_h ? dh0 : NULL);
            REAL *dprev_c = s ? (dcs ? dcs + starts[s - 1] * H : NULL) : dc0;
            for (long r = 0; r < b && width > 0; r++) {
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
            lamina_spin_wait(&barrier, nt, &sense);
            if (dprev_h && width > 0)  /* dh_prev[:, units] += dG_t W_hh[:, units] */
                SUFFIXED(panel_gemm)(b, GH, H, dgh + r0 * GH, GH, packed, q0, q1, dprev_h, H, 1);
        }
    }
}
