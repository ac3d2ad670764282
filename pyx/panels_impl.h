/* The panel GEMM for the REAL type panels.h sets (VEC: a vector of LANES REALs; NR = 2·LANES). */

#if defined(LAMINA_TARGET_V4)
/* a panel's row (NR = 2·LANES values, 64 bytes) as one AVX-512 vector */
typedef REAL SUFFIXED(panel_row) __attribute__((vector_size(2 * sizeof(VEC))));
#define PANEL_ROW SUFFIXED(panel_row)
#endif

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

/* Start fetching a tile row of c (NR values: one 64-byte line) while its sums run. c is often
 * far out of cache: a recurrent step's gates were written by the input projection over all
 * steps long before, and a step's rows are visited a panel at a time. Waiting for those lines
 * at the store cost a sixth of the product's speed against a cached output. Write intent: the
 * line is stored to. */
static inline __attribute__((always_inline)) void SUFFIXED(panel_prefetch)(const REAL *c) {
    __builtin_prefetch(c, 1, 3);
}

/* What a pointwise convolution's tile does as it stores (NULL in a plain product): add its row's
 * bias (row_bias + the tile's first row, or NULL) or its columns' biases (col_bias: NR values,
 * or NULL), then a ReLU (act 1) or a ReLU capped at cap (act 2), as epilogue.h's kernels do. */
typedef struct {
    const REAL *row_bias, *col_bias;
    int act;
    REAL cap;
} SUFFIXED(panel_epilogue);

/* One row of a tile back to c: c[j·cstep] = acc[j] + beta·c[j·cstep] for j < nr (c not read when
 * beta is 0), or with an epilogue act(acc + bias) (beta unused). cstep is 1 (a row of c) or the
 * distance between c's columns (a tile stored transposed). */
static inline __attribute__((always_inline)) void SUFFIXED(panel_store)(REAL *c, long cstep, long nr, VEC lo,
                                                                        VEC hi, REAL beta,
                                                                        const SUFFIXED(panel_epilogue) *epi, long row) {
    const long NR = 2 * LANES;
    if (epi) {
        if (epi->row_bias) {
            lo += epi->row_bias[row];
            hi += epi->row_bias[row];
        }
        if (epi->col_bias) {
            VEC b0, b1;
            memcpy(&b0, epi->col_bias, sizeof b0);
            memcpy(&b1, epi->col_bias + LANES, sizeof b1);
            lo += b0;
            hi += b1;
        }
        if (epi->act == 1) {
            lo = SUFFIXED(relu)(lo);
            hi = SUFFIXED(relu)(hi);
        } else if (epi->act == 2) {
            lo = SUFFIXED(relu_capped)(lo, epi->cap);
            hi = SUFFIXED(relu_capped)(hi, epi->cap);
        }
        beta = 0;
    }
    if (nr == NR && cstep == 1) {
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
        for (long j = 0; j < nr; j++) c[j * cstep] = beta != 0 ? t[j] + beta * c[j * cstep] : t[j];
    }
}

#if defined(LAMINA_TARGET_V4)
/* panel_store of a row of sums held as one 64-byte vector (its two 32-byte halves) */
static inline __attribute__((always_inline)) void SUFFIXED(panel_store_row)(REAL *c, long cstep, long nr,
                                                                            PANEL_ROW sums, REAL beta,
                                                                            const SUFFIXED(panel_epilogue) *epi,
                                                                            long row) {
    VEC lo, hi;
    memcpy(&lo, &sums, sizeof lo);
    memcpy(&hi, (const char *)&sums + sizeof lo, sizeof hi);
    SUFFIXED(panel_store)(c, cstep, nr, lo, hi, beta, epi, row);
}
#endif

/* One tile: rows [0, mr) of c (mr <= ROWS <= PANEL_MR) from the same rows of a and one panel
 * (its rows ldp values apart: NR in a pack, a row of the matrix itself in a pointwise
 * convolution). a's row i holds its depth kk at a[i·lda + kk·astep], c's row i its column j at
 * c[i·ldc + j·cstep]: astep and cstep are 1 but in a pointwise convolution by positions, which
 * reads the input as its transpose and stores the tile transposed. ROWS (and the steps) are
 * constants where this is inlined, so the loops over rows unroll and the 2·ROWS sums stay in
 * registers; rows past mr read row 0 again and are not stored. (x = v - 0 broadcasts v: unlike
 * v + 0 it is exact for -0, so the compiler drops the subtraction.) */
static inline __attribute__((always_inline)) void SUFFIXED(panel_tile)(const long ROWS, long mr, long k,
                                                                       const REAL *a, long lda, long astep,
                                                                       const REAL *panel, long ldp, REAL *c,
                                                                       long ldc, long cstep, long nr, REAL beta,
                                                                       const SUFFIXED(panel_epilogue) *epi) {
    const REAL *ar[PANEL_MR];
    for (long i = 0; i < ROWS; i++) {
        ar[i] = a + (i < mr ? i : 0) * lda;
        if (i < mr) SUFFIXED(panel_prefetch)(c + i * ldc);
    }
    const REAL *bp = panel;
#if defined(LAMINA_TARGET_V4)
    /* a row of the panel is one 64-byte vector: one load and one multiply-add a row of a, where two
     * 32-byte halves took two (512-bit FMAs do twice the work at the same rate on CPUs with two
     * 512-bit FMA units) */
    PANEL_ROW sums[PANEL_MR];
    for (long i = 0; i < ROWS; i++) sums[i] = (PANEL_ROW){0};
    for (long kk = 0; kk < k; kk++, bp += ldp) {
        PANEL_ROW b;
        memcpy(&b, bp, sizeof b);
        for (long i = 0; i < ROWS; i++) sums[i] += (ar[i][kk * astep] - (PANEL_ROW){0}) * b;
    }
    for (long i = 0; i < ROWS; i++)
        if (i < mr) SUFFIXED(panel_store_row)(c + i * ldc, cstep, nr, sums[i], beta, epi, i);
#else
    VEC lo[PANEL_MR], hi[PANEL_MR];
    for (long i = 0; i < ROWS; i++) {
        lo[i] = (VEC){0};
        hi[i] = (VEC){0};
    }
    for (long kk = 0; kk < k; kk++, bp += ldp) {
        VEC b0, b1;
        memcpy(&b0, bp, sizeof b0);
        memcpy(&b1, bp + LANES, sizeof b1);
        for (long i = 0; i < ROWS; i++) {
            VEC x = ar[i][kk * astep] - (VEC){0};
            lo[i] += x * b0;
            hi[i] += x * b1;
        }
    }
    for (long i = 0; i < ROWS; i++)
        if (i < mr) SUFFIXED(panel_store)(c + i * ldc, cstep, nr, lo[i], hi[i], beta, epi, i);
#endif
}

/* One or two rows (a lone sequence's step, the tail of a batch): the sums above would be two or
 * four chains of dependent multiply-adds, each waiting on the last one's latency, so the panel
 * would stream in at a fraction of the rate the loads allow. Here even and odd kk go to two sets
 * of sums, added at the end: twice the chains, twice the rate. ROWS (1 or 2) is a constant
 * where this is inlined. */
static inline __attribute__((always_inline)) void SUFFIXED(panel_tile_narrow)(const long ROWS, long k, const REAL *a,
                                                                              long lda, long astep,
                                                                              const REAL *panel, long ldp, REAL *c,
                                                                              long ldc, long cstep, long nr,
                                                                              REAL beta,
                                                                              const SUFFIXED(panel_epilogue) *epi) {
#if defined(LAMINA_TARGET_V4)
    /* 64-byte rows of the panel, four sets of sums (kk mod 4): as many chains as the two halves'
     * two sets, each a whole row */
    PANEL_ROW sums[4][2];
    for (long s = 0; s < 4; s++)
        for (long i = 0; i < ROWS; i++) sums[s][i] = (PANEL_ROW){0};
    for (long i = 0; i < ROWS; i++)
        SUFFIXED(panel_prefetch)(c + i * ldc);
    const REAL *bp = panel;
    long kk = 0;
    for (; kk + 3 < k; kk += 4, bp += 4 * ldp)
        for (long s = 0; s < 4; s++) {
            PANEL_ROW b;
            memcpy(&b, bp + s * ldp, sizeof b);
            for (long i = 0; i < ROWS; i++) sums[s][i] += (a[i * lda + (kk + s) * astep] - (PANEL_ROW){0}) * b;
        }
    for (; kk < k; kk++, bp += ldp) {
        PANEL_ROW b;
        memcpy(&b, bp, sizeof b);
        for (long i = 0; i < ROWS; i++) sums[0][i] += (a[i * lda + kk * astep] - (PANEL_ROW){0}) * b;
    }
    for (long i = 0; i < ROWS; i++)
        SUFFIXED(panel_store_row)(c + i * ldc, cstep, nr, (sums[0][i] + sums[1][i]) + (sums[2][i] + sums[3][i]),
                                  beta, epi, i);
#else
    VEC lo[2][2], hi[2][2];
    for (long s = 0; s < 2; s++)
        for (long i = 0; i < ROWS; i++) {
            lo[s][i] = (VEC){0};
            hi[s][i] = (VEC){0};
        }
    for (long i = 0; i < ROWS; i++)
        SUFFIXED(panel_prefetch)(c + i * ldc);
    const REAL *bp = panel;
    long kk = 0;
    for (; kk + 1 < k; kk += 2, bp += 2 * ldp) {
        VEC b0, b1, b2, b3;
        memcpy(&b0, bp, sizeof b0);
        memcpy(&b1, bp + LANES, sizeof b1);
        memcpy(&b2, bp + ldp, sizeof b2);
        memcpy(&b3, bp + ldp + LANES, sizeof b3);
        for (long i = 0; i < ROWS; i++) {
            VEC x = a[i * lda + kk * astep] - (VEC){0}, y = a[i * lda + (kk + 1) * astep] - (VEC){0};
            lo[0][i] += x * b0;
            hi[0][i] += x * b1;
            lo[1][i] += y * b2;
            hi[1][i] += y * b3;
        }
    }
    if (kk < k) {
        VEC b0, b1;
        memcpy(&b0, bp, sizeof b0);
        memcpy(&b1, bp + LANES, sizeof b1);
        for (long i = 0; i < ROWS; i++) {
            VEC x = a[i * lda + kk * astep] - (VEC){0};
            lo[0][i] += x * b0;
            hi[0][i] += x * b1;
        }
    }
    for (long i = 0; i < ROWS; i++)
        SUFFIXED(panel_store)(c + i * ldc, cstep, nr, lo[0][i] + lo[1][i], hi[0][i] + hi[1][i], beta, epi, i);
#endif
}

/* Rows [0, mr) of c from the same rows of a and one panel, the tile for mr rows (PANEL_MR, 6, 4,
 * 2, 1); astep and cstep as panel_tile's. */
static inline __attribute__((always_inline)) void SUFFIXED(panel_rows)(long mr, long k, const REAL *a, long lda,
                                                                       long astep, const REAL *panel, long ldp,
                                                                       REAL *c, long ldc, long cstep, long nr,
                                                                       REAL beta,
                                                                       const SUFFIXED(panel_epilogue) *epi) {
#if PANEL_MR > 6
    if (mr > 6)
        SUFFIXED(panel_tile)(PANEL_MR, mr, k, a, lda, astep, panel, ldp, c, ldc, cstep, nr, beta, epi);
    else
#endif
    if (mr > 4)
        SUFFIXED(panel_tile)(6, mr, k, a, lda, astep, panel, ldp, c, ldc, cstep, nr, beta, epi);
    else if (mr > 2)
        SUFFIXED(panel_tile)(4, mr, k, a, lda, astep, panel, ldp, c, ldc, cstep, nr, beta, epi);
    else if (mr == 2)
        SUFFIXED(panel_tile_narrow)(2, k, a, lda, astep, panel, ldp, c, ldc, cstep, nr, beta, epi);
    else
        SUFFIXED(panel_tile_narrow)(1, k, a, lda, astep, panel, ldp, c, ldc, cstep, nr, beta, epi);
}

/* c[m x n] = a[m x k] · P + beta·c over panels [p0, p1) of P (their columns of c only). Rows go
 * in tiles of PANEL_MR; the last tile of a remainder takes 6 or 4 rows when that covers it, and 1
 * or 2 rows the narrow tile, so a step's odd row count wastes at most one row of multiply-adds. */
LAMINA_CLONES static void SUFFIXED(panel_gemm)(long m, long k, long n, const REAL *a, long lda,
                                               const REAL *packed, long p0, long p1, REAL *c, long ldc,
                                               REAL beta) {
    const long NR = 2 * LANES;
    long block = PANEL_ROW_BYTES / (k * (long)sizeof(REAL)) / PANEL_MR * PANEL_MR;
    block = block < PANEL_MR ? PANEL_MR : block;
    long run = PANEL_RUN_BYTES / (k * NR * (long)sizeof(REAL));
    run = run < 1 ? 1 : run;
    for (long q0 = p0; q0 < p1; q0 += run)
    for (long i0 = 0; i0 < m; i0 += block) {
        long i1 = m - i0 < block ? m : i0 + block;
        for (long p = q0; p < (p1 - q0 < run ? p1 : q0 + run); p++) {
            const REAL *panel = packed + p * k * NR;
            long col = p * NR, nr = n - col < NR ? n - col : NR;
            for (long i = i0; i < i1; i += PANEL_MR) {
                long mr = i1 - i < PANEL_MR ? i1 - i : PANEL_MR;
                SUFFIXED(panel_rows)(mr, k, a + i * lda, lda, 1, panel, NR, c + i * ldc + col, ldc, 1, nr, beta,
                                     NULL);
            }
        }
    }
}

/* panel_gemm on a team of `threads` (team.h): member t takes its share of the panels [p0, p1),
 * or with by_rows its block of whole row tiles; with a bias (n values, or NULL) each member first
 * sets its part of c to it and adds the product (beta unused). */
typedef struct {
    long m, k, n, lda, ldc, p0, p1;
    const REAL *a, *packed, *bias;
    REAL *c;
    REAL beta;
    int by_rows;
} SUFFIXED(panel_gemm_job);

static void SUFFIXED(panel_gemm_member)(void *job, int t, int nt) {
    const SUFFIXED(panel_gemm_job) *j = job;
    const long NR = 2 * LANES;
    const lamina_product_share sh = lamina_product_share_of(j->by_rows, j->m, PANEL_MR, j->p0, j->p1, t, nt);
    const long r0 = sh.r0, r1 = sh.r1, q0 = sh.q0, q1 = sh.q1;
    if (r0 >= r1 || q0 >= q1)
        return;
    REAL beta = j->beta;
    if (j->bias) {
        long c0 = q0 * NR, c1 = q1 * NR < j->n ? q1 * NR : j->n;
        for (long r = r0; r < r1; r++)
            memcpy(j->c + r * j->ldc + c0, j->bias + c0, sizeof(REAL) * (c1 - c0));
        beta = 1;
    }
    SUFFIXED(panel_gemm)(r1 - r0, j->k, j->n, j->a + r0 * j->lda, j->lda, j->packed, q0, q1, j->c + r0 * j->ldc,
                         j->ldc, beta);
}

static void SUFFIXED(panel_gemm_team)(long m, long k, long n, const REAL *a, long lda, const REAL *packed, long p0,
                                      long p1, REAL *c, long ldc, REAL beta, const REAL *bias, int threads,
                                      int by_rows) {
    SUFFIXED(panel_gemm_job) job = {m, k, n, lda, ldc, p0, p1, a, packed, bias, c, beta, by_rows};
    lamina_team_run(threads, SUFFIXED(panel_gemm_member), &job);
}

/* A pointwise convolution of one sample: y[cout x S] = act(w[cout x cin] · x[cin x S] + bias)
 * (epi: the bias per output channel and the activation; x's rows ldx apart, y's ldy: a block of
 * a column matrix and its columns of y), the panel tiles reading x itself: a panel is 16 (or 8
 * double) columns of x, its rows ldx apart, stored as act(sum + bias), so y is
 * written once (a GEMM into y, a bias pass and an activation pass wrote it three times). Columns
 * [16·q0, 16·q1) of S >= NR; the member with q1 = the last whole panel also takes the tail past it
 * as a panel ending where x's rows end (its first columns computed again, the same values). The
 * columns go in chunks whose x stays in L2 while every row tile of w passes over it. */
LAMINA_CLONES static void SUFFIXED(pointwise_conv)(long cout, long cin, long S, const REAL *w, const REAL *x,
                                                   long ldx, REAL *y, long ldy,
                                                   const SUFFIXED(panel_epilogue) *epi, long q0, long q1) {
    const long NR = 2 * LANES, whole = S / NR;
    long chunk = PANEL_RUN_BYTES / 2 / (cin * NR * (long)sizeof(REAL));
    chunk = chunk < 1 ? 1 : chunk;
    long last = q1 == whole && S % NR ? q1 + 1 : q1;  /* the tail's panel, if this member takes it */
    for (long c0 = q0; c0 < last; c0 += chunk) {
        long c1 = last - c0 < chunk ? last : c0 + chunk;
        for (long i = 0; i < cout; i += PANEL_MR) {
            long mr = cout - i < PANEL_MR ? cout - i : PANEL_MR;
            SUFFIXED(panel_epilogue) rows = {epi->row_bias ? epi->row_bias + i : NULL, NULL, epi->act, epi->cap};
            for (long p = c0; p < c1; p++) {
                long col = p < whole ? p * NR : S - NR;
                SUFFIXED(panel_rows)(mr, cin, w + i * cin, cin, 1, x + col, ldx, y + i * ldy + col, ldy, 1, NR, 0,
                                     &rows);
            }
        }
    }
}

typedef struct {
    long cout, cin, S, ldx, ldy;
    const REAL *w, *x;
    REAL *y;
    SUFFIXED(panel_epilogue) epi;
} SUFFIXED(pointwise_job);

static void SUFFIXED(pointwise_member)(void *job, int t, int nt) {
    const SUFFIXED(pointwise_job) *j = job;
    const long whole = j->S / (2 * LANES), q0 = t * whole / nt, q1 = (t + 1) * whole / nt;
    if (q0 < q1)
        SUFFIXED(pointwise_conv)(j->cout, j->cin, j->S, j->w, j->x, j->ldx, j->y, j->ldy, &j->epi, q0, q1);
}

/* pointwise_conv of a whole sample on a team of up to `threads` (at most one per whole panel) */
static void SUFFIXED(pointwise_conv_team)(long cout, long cin, long S, const REAL *w, const REAL *x, long ldx,
                                          REAL *y, long ldy, const REAL *bias, int act, REAL cap, int threads) {
    const long whole = S / (2 * LANES);
    SUFFIXED(pointwise_job) job = {cout, cin, S, ldx, ldy, w, x, y, {bias, NULL, act, cap}};
    lamina_team_run(threads < whole ? threads : (int)whole, SUFFIXED(pointwise_member), &job);
}

/* A pointwise convolution of one sample by positions: y[cout x S] = act(w · x + bias), as
 * pointwise_conv but with the roles turned: c = xᵀ · wᵀ, tiles of PANEL_MR positions x one panel of 16
 * (8 double) output channels, wᵀ packed once into panels (panel_pack of w transposed: a pack
 * whose panels stream contiguously), x read in place as its transpose (position i, depth kk at
 * x[kk·ldx + i]) and each tile stored transposed into y (channel j, position i at y[j·ldy + i]) with
 * its channels' biases and the activation. For samples of few positions (a panel of positions
 * would be mostly padding) and deep inputs (rows of w broadcast from cin apart), where the
 * product over panels of positions loses. Panels [q0, q1) of the output channels, positions
 * [r0, r1): each panel passes over every position, so x is read once a panel (the caller keeps
 * x and a panel within the L2 cache). */
LAMINA_CLONES static void SUFFIXED(pointwise_positions)(long cout, long cin, long S, const REAL *packed,
                                                        const REAL *x, long ldx, REAL *y, long ldy,
                                                        const SUFFIXED(panel_epilogue) *epi, long q0, long q1,
                                                        long r0, long r1) {
    const long NR = 2 * LANES;
    for (long p = q0; p < q1; p++) {
        const long col = p * NR, nr = cout - col < NR ? cout - col : NR;
        REAL bias[2 * LANES] = {0};
        for (long j = 0; j < nr && epi->col_bias; j++) bias[j] = epi->col_bias[col + j];
        SUFFIXED(panel_epilogue) cols = {NULL, epi->col_bias ? bias : NULL, epi->act, epi->cap};
        const REAL *panel = packed + p * cin * NR;
        for (long i = r0; i < r1; i += PANEL_MR) {
            long mr = r1 - i < PANEL_MR ? r1 - i : PANEL_MR;
            SUFFIXED(panel_rows)(mr, cin, x + i, 1, ldx, panel, NR, y + col * ldy + i, 1, ldy, nr, 0, &cols);
        }
    }
}

typedef struct {
    long cout, cin, S, ldx, ldy;
    const REAL *packed, *x;
    REAL *y;
    SUFFIXED(panel_epilogue) epi;
    int by_rows;
} SUFFIXED(positions_job);

static void SUFFIXED(positions_member)(void *job, int t, int nt) {
    const SUFFIXED(positions_job) *j = job;
    const lamina_product_share sh =
        lamina_product_share_of(j->by_rows, j->S, PANEL_MR, 0, SUFFIXED(panel_count)(j->cout), t, nt);
    if (sh.r0 < sh.r1 && sh.q0 < sh.q1)
        SUFFIXED(pointwise_positions)(j->cout, j->cin, j->S, j->packed, j->x, j->ldx, j->y, j->ldy, &j->epi, sh.q0,
                                      sh.q1, sh.r0, sh.r1);
}

/* pointwise_positions of a whole sample on a team of up to `threads`: each member takes a share
 * of the output channels' panels, or where there are fewer panels than twice the team, a share
 * of the positions' tiles. bias: cout values or NULL. */
static void SUFFIXED(pointwise_positions_team)(long cout, long cin, long S, const REAL *packed, const REAL *x,
                                               long ldx, REAL *y, long ldy, const REAL *bias, int act, REAL cap,
                                               int threads) {
    const long panels = SUFFIXED(panel_count)(cout), tiles = (S + PANEL_MR - 1) / PANEL_MR;
    const int by_rows = panels < 2L * threads;
    const long shares = by_rows ? tiles : panels;
    SUFFIXED(positions_job) job = {cout, cin, S, ldx, ldy, packed, x, y, {NULL, bias, act, cap}, by_rows};
    lamina_team_run(threads < shares ? threads : (int)shares, SUFFIXED(positions_member), &job);
}

#undef PANEL_ROW
