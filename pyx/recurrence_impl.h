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
        int t = omp_get_thread_num(), nt = omp_get_num_threads(), sense = 0;
        long q0 = t * unit_panels / nt, q1 = (t + 1) * unit_panels / nt;
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
