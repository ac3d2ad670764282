/* One row of a recurrent cell (H hidden units), for the REAL type the including file sets.
 * Included by cells.h once for float and once for double. Plain loops over restrict pointers,
 * so gcc vectorises them (with -fno-trapping-math for the conditional expressions in TANH);
 * each row function is also compiled for AVX2 + FMA (clones.h): 8-wide, with fused multiply-adds
 * in the tanh polynomial, several times faster per element than the SSE2 baseline. */

static inline REAL SUFFIXED(sigm)(REAL x) { return (REAL)0.5 + (REAL)0.5 * TANH((REAL)0.5 * x); }

/* g: the row's 4H gate pre-activations in (plus bias, laid out like g, unless NULL), activated
 * i, f, g, o out; c = f c_prev + i g; h = o tanh(c). c_prev NULL means zero. Units [0, n) of the
 * row: gate k of unit j at g[k·H + j] (n = H for a whole row; a thread of the fused recurrence
 * takes a block of units). */
static inline __attribute__((always_inline)) void SUFFIXED(lstm_pass)(
        long n, long H, REAL *restrict g, const REAL *restrict bias, const REAL *restrict c_prev,
        REAL *restrict c, REAL *restrict h, const int with_bias, const int with_prev) {
    for (long j = 0; j < n; j++) {
        REAL zi = g[j], zf = g[H + j], zg = g[2 * H + j], zo = g[3 * H + j];
        if (with_bias) {
            zi += bias[j]; zf += bias[H + j]; zg += bias[2 * H + j]; zo += bias[3 * H + j];
        }
        REAL gi = SUFFIXED(sigm)(zi), gf = SUFFIXED(sigm)(zf), gg = TANH(zg), go = SUFFIXED(sigm)(zo);
        g[j] = gi; g[H + j] = gf; g[2 * H + j] = gg; g[3 * H + j] = go;
        REAL cj = gi * gg;
        if (with_prev)
            cj += gf * c_prev[j];
        c[j] = cj;
        h[j] = go * TANH(cj);
    }
}

/* One pass over the row: the gates are read once, right after the step's GEMM wrote them (a
 * pass each for the bias, the gates, the cell and the output read them four times), specialised
 * on bias and c_prev (LAMINA_SPECIALISED). */
LAMINA_CLONES static void SUFFIXED(lstm_row)(long n, long H, REAL *restrict g, const REAL *restrict bias,
                                             const REAL *restrict c_prev, REAL *restrict c, REAL *restrict h) {
    LAMINA_SPECIALISED(SUFFIXED(lstm_pass), bias, c_prev, n, H, g, bias, c_prev, c, h);
}

/* dg: gradient of the row's gate pre-activations, from dh and the carried cell gradient dc;
 * dc_prev += (dc + dh o tanh'(c)) f unless NULL. Units [0, n) (as lstm_row). */
LAMINA_CLONES static void SUFFIXED(lstm_row_backward)(long n, long H, const REAL *restrict g,
                                                      const REAL *restrict c_prev, const REAL *restrict c,
                                                      const REAL *restrict dh, const REAL *restrict dc,
                                                      REAL *restrict dg, REAL *restrict dc_prev) {
    for (long j = 0; j < n; j++) {
        REAL gi = g[j], gf = g[H + j], gg = g[2 * H + j], go = g[3 * H + j];
        REAL tc = TANH(c[j]);
        REAL dct = dc[j] + dh[j] * go * (1 - tc * tc);
        dg[j] = dct * gg * gi * (1 - gi);
        dg[H + j] = c_prev ? dct * c_prev[j] * gf * (1 - gf) : 0;
        dg[2 * H + j] = dct * gi * (1 - gg * gg);
        dg[3 * H + j] = dh[j] * tc * go * (1 - go);
        if (dc_prev) dc_prev[j] += dct * gf;
    }
}

/* g: the row's 3H input parts (x W_ihᵀ, plus b_ih unless NULL) in, activated r, z, n out;
 * hh = h_prev W_hhᵀ + b_hh; h = (1 - z) n + z h_prev with n = tanh(g_n + r hh_n). h_prev NULL
 * means zero. Units [0, n) of the row, gate k of unit j at k·H + j (as lstm_row). */
static inline __attribute__((always_inline)) void SUFFIXED(gru_pass)(
        long n, long H, REAL *restrict g, const REAL *restrict bias, const REAL *restrict hh,
        const REAL *restrict h_prev, REAL *restrict h, const int with_bias, const int with_prev) {
    for (long j = 0; j < n; j++) {
        REAL zr = g[j], zz = g[H + j], zn = g[2 * H + j];
        if (with_bias) {
            zr += bias[j]; zz += bias[H + j]; zn += bias[2 * H + j];
        }
        REAL r = SUFFIXED(sigm)(zr + hh[j]);
        REAL z = SUFFIXED(sigm)(zz + hh[H + j]);
        REAL nn = TANH(zn + r * hh[2 * H + j]);
        g[j] = r; g[H + j] = z; g[2 * H + j] = nn;
        REAL hj = (1 - z) * nn;
        if (with_prev)
            hj += z * h_prev[j];
        h[j] = hj;
    }
}

/* One pass over the row, specialised on bias and h_prev (as lstm_row). */
LAMINA_CLONES static void SUFFIXED(gru_row)(long n, long H, REAL *restrict g, const REAL *restrict bias,
                                            const REAL *restrict hh, const REAL *restrict h_prev,
                                            REAL *restrict h) {
    LAMINA_SPECIALISED(SUFFIXED(gru_pass), bias, h_prev, n, H, g, bias, hh, h_prev, h);
}

/* dgx, dgh: gradients of the input part g and the recurrent part hh; dh_prev += dh z unless NULL.
 * Units [0, n) (as gru_row). */
LAMINA_CLONES static void SUFFIXED(gru_row_backward)(long n, long H, const REAL *restrict g,
                                                     const REAL *restrict hh, const REAL *restrict h_prev,
                                                     const REAL *restrict dh, REAL *restrict dgx,
                                                     REAL *restrict dgh, REAL *restrict dh_prev) {
    for (long j = 0; j < n; j++) {
        REAL r = g[j], z = g[H + j], nn = g[2 * H + j], d = dh[j];
        REAL hp = h_prev ? h_prev[j] : 0;
        REAL dn = d * (1 - z) * (1 - nn * nn);
        REAL dz = d * (hp - nn) * z * (1 - z);
        REAL dr = dn * hh[2 * H + j] * r * (1 - r);
        dgx[j] = dr; dgx[H + j] = dz; dgx[2 * H + j] = dn;
        dgh[j] = dr; dgh[H + j] = dz; dgh[2 * H + j] = dn * r;
        if (dh_prev) dh_prev[j] += d * z;
    }
}
