/* The panel GEMM for the REAL type panels.h sets (VEC: a vector of LANES REALs; NR = 2·LANES). */

/* panels needed for n columns */
static inline long SUFFIXED(panel_count)(long n) { return (n + 2 * LANES - 1) / (2 * LANES); }

/* Panels [p0, p1) of alpha·op(b), op(b) k x n: op(b)[kk, j] = b[j·ldb + kk] if trans else
 * b[kk·ldb + j]. Columns past n are zero. out holds panel_count(n)·k·NR values. */
static void SUFFIXED(panel_pack)(const REAL *restrict b, long ldb, int trans, long k, long n, REAL alpha,
                                 long p0, long p1, REAL *restrict out) {
    const long NR = 2 * LANES;
    for (long p = p0; p < p1; p++) {
        REAL *dst = out + p * k * NR;
        for (long j = 0; j < NR; j++) {
            long col = p * NR + j;
            if (col >= n) {
                for (long kk = 0; kk < k; kk++) dst[kk * NR + j] = 0;
            } else if (trans) {
                const REAL *src = b + col * ldb;  /* a row of b: contiguous reads */
                for (long kk = 0; kk < k; kk++) dst[kk * NR + j] = alpha * src[kk];
            } else {
                for (long kk = 0; kk < k; kk++) dst[kk * NR + j] = alpha * b[kk * ldb + col];
            }
        }
    }
}

/* One row of a tile back to c: c[0..nr) = acc + beta·c (c not read when beta is 0). */
static inline __attribute__((always_inline)) void SUFFIXED(panel_store)(REAL *c, long nr, VEC lo, VEC hi, REAL beta) {
    const long NR = 2 * LANES;
    if (nr == NR) {
        if (beta != 0) {
            VEC o0, o1;
            memcpy(&o0, c, sizeof o0);
            memcpy(&o1, c + LANES, sizeof o1);
            lo += beta * o0;
            hi += beta * o1;
        }
        memcpy(c, &lo, sizeof lo);
        memcpy(c + LANES, &hi, sizeof hi);
    } else {
        REAL t[2 * LANES];
        memcpy(t, &lo, sizeof lo);
        memcpy(t + LANES, &hi, sizeof hi);
        for (long j = 0; j < nr; j++) c[j] = beta != 0 ? t[j] + beta * c[j] : t[j];
    }
}

/* c[m x n] = a[m x k] · P + beta·c over panels [p0, p1) of P (their columns of c only). */
LAMINA_CLONES static void SUFFIXED(panel_gemm)(long m, long k, long n, const REAL *a, long lda,
                                               const REAL *packed, long p0, long p1, REAL *c, long ldc,
                                               REAL beta) {
    const long NR = 2 * LANES;
    for (long p = p0; p < p1; p++) {
        const REAL *panel = packed + p * k * NR;
        long col = p * NR, nr = n - col < NR ? n - col : NR;
        for (long i = 0; i < m; i += PANEL_MR) {
            long mr = m - i < PANEL_MR ? m - i : PANEL_MR;
            /* rows past mr read row 0 again; their sums are not stored. (x = v - 0 broadcasts v:
             * unlike v + 0 it is exact for -0, so the compiler drops the subtraction) */
            const REAL *a0 = a + i * lda;
            const REAL *a1 = mr > 1 ? a0 + lda : a0, *a2 = mr > 2 ? a0 + 2 * lda : a0;
            const REAL *a3 = mr > 3 ? a0 + 3 * lda : a0, *a4 = mr > 4 ? a0 + 4 * lda : a0;
            const REAL *a5 = mr > 5 ? a0 + 5 * lda : a0;
            VEC c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
            VEC c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
            const REAL *bp = panel;
            for (long kk = 0; kk < k; kk++, bp += NR) {
                VEC b0, b1, x;
                memcpy(&b0, bp, sizeof b0);
                memcpy(&b1, bp + LANES, sizeof b1);
                x = a0[kk] - (VEC){0}; c00 += x * b0; c01 += x * b1;
                x = a1[kk] - (VEC){0}; c10 += x * b0; c11 += x * b1;
                x = a2[kk] - (VEC){0}; c20 += x * b0; c21 += x * b1;
                x = a3[kk] - (VEC){0}; c30 += x * b0; c31 += x * b1;
                x = a4[kk] - (VEC){0}; c40 += x * b0; c41 += x * b1;
                x = a5[kk] - (VEC){0}; c50 += x * b0; c51 += x * b1;
            }
            REAL *ci = c + i * ldc + col;
            SUFFIXED(panel_store)(ci, nr, c00, c01, beta);
            if (mr > 1) SUFFIXED(panel_store)(ci + ldc, nr, c10, c11, beta);
            if (mr > 2) SUFFIXED(panel_store)(ci + 2 * ldc, nr, c20, c21, beta);
            if (mr > 3) SUFFIXED(panel_store)(ci + 3 * ldc, nr, c30, c31, beta);
            if (mr > 4) SUFFIXED(panel_store)(ci + 4 * ldc, nr, c40, c41, beta);
            if (mr > 5) SUFFIXED(panel_store)(ci + 5 * ldc, nr, c50, c51, beta);
        }
    }
}
