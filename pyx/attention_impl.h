/* Included by instantiate.h once per element type (REAL, EXP, SUFFIXED).
 *
 * A sequence is rows [a, b) of qkv [rows, 3E]; head h's query, key and value of row r are
 * qkv[r, h*d : (h+1)*d], qkv[r, E + h*d : …] and qkv[r, 2E + h*d : …]. Query i attends to the keys
 * j of its own sequence (j <= i when causal):
 *     s_ij = scale q_i·k_j,   lse_i = log Σ_j exp(s_ij),   p_ij = exp(s_ij - lse_i),
 *     out[i, h*d + c] = Σ_j p_ij v_j[c].
 * kt (and vt) are scratch of d * (b - a) values: the sequence's keys (values) transposed, so a
 * query's scores against a block of keys are d multiply-adds over contiguous rows (they
 * vectorise); no array of all the sequence's scores is ever held. */

static inline __attribute__((always_inline)) void SUFFIXED(transpose_head)(const REAL* qkv, long ld, long col, long a,
                                                                           long n, long d, REAL* t) {
    long j = 0;
    for (; j + LANES <= n; j += LANES) {  /* LANES keys x LANES columns through registers */
        const REAL* rows = qkv + (a + j) * ld + col;
        long c = 0;
        for (; c + LANES <= d; c += LANES) SUFFIXED(transpose_block)(rows + c, ld, t + c * n + j, n);
        for (; c < d; c++)
            for (long i = 0; i < LANES; i++) t[c * n + j + i] = rows[i * ld + c];
    }
    for (; j < n; j++) {
        const REAL* row = qkv + (a + j) * ld + col;
        for (long c = 0; c < d; c++) t[c * n + j] = row[c];
    }
}

/* LANES values from p, which need not be aligned */
static inline VEC SUFFIXED(load)(const REAL* p) {
    VEC v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* the largest of x[0 .. n) (-inf for none; NaN never replaces a value) */
static inline REAL SUFFIXED(span_max)(const REAL* x, long n) {
    VEC top = (VEC){0} - (REAL)INFINITY;
    long j = 0;
    for (; j + LANES <= n; j += LANES) top = SUFFIXED(pool_max)(top, SUFFIXED(load)(x + j));
    REAL m = -INFINITY;
    for (int k = 0; k < LANES; k++) m = top[k] > m ? top[k] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    return m;
}

/* x[j] = exp(x[j] - m) for j < n and 0 for n <= j < w; returns their sum (float: 8 lanes at a
 * time through lamina_fast_expf8) */
static inline REAL SUFFIXED(exp_span)(REAL* x, REAL m, long n, long w) {
    REAL total = 0;
    long j = 0;
#if LANES == 8
    VEC sum = (VEC){0};
    for (; j + LANES <= n; j += LANES) {
        const VEC e = lamina_fast_expf8(SUFFIXED(load)(x + j) - m);
        memcpy(x + j, &e, sizeof e);
        sum += e;
    }
    for (int k = 0; k < LANES; k++) total += sum[k];
#endif
    for (; j < n; j++) {
        x[j] = EXP(x[j] - m);
        total += x[j];
    }
    for (; j < w; j++) x[j] = 0;
    return total;
}

/* s[0:w] = (scale q)·k_j for the keys j0 .. j0 + w of a head transposed into kt (n keys) */
LAMINA_CLONES static void SUFFIXED(head_scores)(const REAL* q, REAL scale, const REAL* kt, long n, long d, long j0,
                                                long w, REAL* s) {
    for (long j = 0; j < w; j++) s[j] = 0;
    for (long c = 0; c < d; c++) {
        const REAL qc = q[c] * scale;
        const REAL* row = kt + c * n + j0;
        for (long j = 0; j < w; j++) s[j] += qc * row[j];
    }
}

/* scores[r][0 .. w) = q_r·k_j for the ATTENTION_ROWS (scaled) query rows q_r, each of d values,
 * and the keys j0 .. j0+w of a head transposed into kt (n keys): ATTENTION_KEYS keys at a time,
 * the rows' partial sums held in vector registers while the head's d columns pass, so each load
 * of keys serves every row. Groups past w are computed too (kt has ATTENTION_KEYS values of
 * slack) and never read. */
LAMINA_CLONES static void SUFFIXED(block_scores)(const REAL* qs, const REAL* kt, long n, long d, long j0, long w,
                                                 REAL scores[][ATTENTION_BLOCK + ATTENTION_KEYS]) {
    enum { V = ATTENTION_KEYS / LANES };
    for (long jj = 0; jj < w; jj += ATTENTION_KEYS) {
        VEC t[ATTENTION_ROWS][V];
#pragma GCC unroll 16
        for (int r = 0; r < ATTENTION_ROWS; r++)
#pragma GCC unroll 16
            for (int v = 0; v < V; v++) t[r][v] = (VEC){0};
        for (long c = 0; c < d; c++) {
            VEC kv[V];
#pragma GCC unroll 16
            for (int v = 0; v < V; v++) kv[v] = SUFFIXED(load)(kt + c * n + j0 + jj + v * LANES);
#pragma GCC unroll 16
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                const REAL qc = qs[r * d + c];  /* (a scalar operand is broadcast) */
#pragma GCC unroll 16
                for (int v = 0; v < V; v++) t[r][v] += qc * kv[v];
            }
        }
        for (int r = 0; r < ATTENTION_ROWS; r++)
            for (int v = 0; v < V; v++) memcpy(&scores[r][jj + v * LANES], &t[r][v], sizeof(VEC));
    }
}

/* acc[r][0 .. d) += Σ_j p[r][j] v_j for the keys j0 .. j0+w (v_j at v + j * ld): ATTENTION_KEYS
 * columns at a time, the rows' sums held in vector registers while the keys pass */
LAMINA_CLONES static void SUFFIXED(block_values)(const REAL p[][ATTENTION_BLOCK + ATTENTION_KEYS], const REAL* v,
                                                 long ld, long w, long d, REAL* acc) {
    enum { V = ATTENTION_KEYS / LANES };
    long c0 = 0;
    for (; c0 + ATTENTION_KEYS <= d; c0 += ATTENTION_KEYS) {
        VEC o[ATTENTION_ROWS][V];
#pragma GCC unroll 16
        for (int r = 0; r < ATTENTION_ROWS; r++)
#pragma GCC unroll 16
            for (int k = 0; k < V; k++) o[r][k] = SUFFIXED(load)(acc + r * d + c0 + k * LANES);
        for (long j = 0; j < w; j++) {
            VEC vj[V];
#pragma GCC unroll 16
            for (int k = 0; k < V; k++) vj[k] = SUFFIXED(load)(v + j * ld + c0 + k * LANES);
#pragma GCC unroll 16
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                const REAL pj = p[r][j];
#pragma GCC unroll 16
                for (int k = 0; k < V; k++) o[r][k] += pj * vj[k];
            }
        }
        for (int r = 0; r < ATTENTION_ROWS; r++)
            for (int k = 0; k < V; k++) memcpy(acc + r * d + c0 + k * LANES, &o[r][k], sizeof(VEC));
    }
    for (long j = 0; j < w && c0 < d; j++)
        for (int r = 0; r < ATTENTION_ROWS; r++)
            for (long c = c0; c < d; c++) acc[r * d + c] += p[r][j] * v[j * ld + c];
}

/* The head's queries scaled into q [n + ATTENTION_ROWS, d] (the rows past n zero) and its keys
 * (other = E) or values (other = 2E) into v [n, d], contiguous: one pass of independent loads over
 * the sequence's rows, which lie 3E values apart, so the blocks after it read neighbouring
 * values. */
static inline __attribute__((always_inline)) void SUFFIXED(gather_head)(const REAL* qkv, long E, long d, long h,
                                                                       long a, long n, REAL scale, long other,
                                                                       REAL* q, REAL* v) {
    for (long j = 0; j < n; j++) {
        const REAL* row = qkv + (a + j) * 3 * E + h * d;
        for (long c = 0; c < d; c++) {
            q[j * d + c] = row[c] * scale;
            v[j * d + c] = row[other + c];
        }
    }
    for (long c = 0; c < ATTENTION_ROWS * d; c++) q[n * d + c] = 0;
}

/* out and lse (one value per row and head, [rows, heads]) of one (sequence, head), ATTENTION_ROWS
 * queries at a time (the last group padded with zero queries, never written) against blocks of
 * ATTENTION_BLOCK keys, each row's running maximum and sum rescaling its output whenever the
 * maximum rises. kt: scratch of attention_scratch(n, d) values. */
LAMINA_CLONES static void SUFFIXED(attention_head)(const REAL* qkv, long E, long d, long h, long heads, long a,
                                                   long b, REAL scale, int causal, REAL* out, REAL* lse, REAL* kt) {
    const long ld = 3 * E, n = b - a;
    REAL s[ATTENTION_ROWS][ATTENTION_BLOCK + ATTENTION_KEYS], m[ATTENTION_ROWS], l[ATTENTION_ROWS];
    REAL* queries = kt + d * n + ATTENTION_KEYS;       /* (n + ATTENTION_ROWS) x d, scaled */
    REAL* values = queries + (n + ATTENTION_ROWS) * d;  /* n x d */
    REAL* acc = values + n * d;                         /* ATTENTION_ROWS x d running outputs */
    SUFFIXED(transpose_head)(qkv, ld, E + h * d, a, n, d, kt);
    SUFFIXED(gather_head)(qkv, E, d, h, a, n, scale, 2 * E, queries, values);
    for (long i0 = 0; i0 < n; i0 += ATTENTION_ROWS) {
        const long rows = n - i0 < ATTENTION_ROWS ? n - i0 : ATTENTION_ROWS;
        const REAL* qs = queries + i0 * d;
        for (int r = 0; r < ATTENTION_ROWS; r++) {
            m[r] = -INFINITY;
            l[r] = 0;
        }
        for (long c = 0; c < ATTENTION_ROWS * d; c++) acc[c] = 0;
        const long end = causal ? i0 + rows : n;  /* the keys some row of the group sees */
        for (long j0 = 0; j0 < end; j0 += ATTENTION_BLOCK) {
            const long w = end - j0 < ATTENTION_BLOCK ? end - j0 : ATTENTION_BLOCK;
            SUFFIXED(block_scores)(qs, kt, n, d, j0, w, s);
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                long seen = causal ? i0 + r + 1 - j0 : w;  /* this row's keys in the block */
                seen = r >= rows || seen < 0 ? 0 : (seen > w ? w : seen);
                const REAL top = SUFFIXED(span_max)(s[r], seen);
                if (top > m[r]) {
                    const REAL f = m[r] == -INFINITY ? 0 : EXP(m[r] - top);
                    l[r] *= f;
                    for (long c = 0; c < d; c++) acc[r * d + c] *= f;
                    m[r] = top;
                }
                l[r] += SUFFIXED(exp_span)(s[r], m[r], seen, w);
            }
            SUFFIXED(block_values)(s, values + j0 * d, d, w, d, acc);
        }
        for (long r = 0; r < rows; r++) {
            REAL* o = out + (a + i0 + r) * E + h * d;
            const REAL inv = 1 / l[r];
            for (long c = 0; c < d; c++) o[c] = acc[r * d + c] * inv;
            lse[(a + i0 + r) * heads + h] = m[r] + (REAL)log((double)l[r]);
        }
    }
}

/* dk_j += Σ_r ds[r][j] qs_r and dv_j += Σ_r p[r][j] g_r for the keys j0 .. j0+w of one head
 * (dk_j at dk + j * ld, dv_j E values after it): LANES columns at a time, the group's rows of
 * those columns held in registers while the keys pass */
LAMINA_CLONES static void SUFFIXED(block_key_grads)(const REAL ds[][ATTENTION_BLOCK + ATTENTION_KEYS],
                                                    const REAL p[][ATTENTION_BLOCK + ATTENTION_KEYS], const REAL* qs,
                                                    const REAL* gs, long w, long d, REAL* dk, long ld, long E) {
    long c = 0;
    for (; c + LANES <= d; c += LANES) {
        VEC q[ATTENTION_ROWS], g[ATTENTION_ROWS];
#pragma GCC unroll 16
        for (int r = 0; r < ATTENTION_ROWS; r++) {
            q[r] = SUFFIXED(load)(qs + r * d + c);
            g[r] = SUFFIXED(load)(gs + r * d + c);
        }
        for (long j = 0; j < w; j++) {
            REAL* k = dk + j * ld + c;
            VEC gk = SUFFIXED(load)(k), gv = SUFFIXED(load)(k + E);
#pragma GCC unroll 16
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                gk += ds[r][j] * q[r];
                gv += p[r][j] * g[r];
            }
            memcpy(k, &gk, sizeof gk);
            memcpy(k + E, &gv, sizeof gv);
        }
    }
    for (long j = 0; j < w && c < d; j++)
        for (long cc = c; cc < d; cc++)
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                dk[j * ld + cc] += ds[r][j] * qs[r * d + cc];
                dk[j * ld + E + cc] += p[r][j] * gs[r * d + cc];
            }
}

/* p[j] = exp(p[j] - L) and ds[j] = p[j] (ds[j] - D) for j < n, both 0 for n <= j < w (float: 8
 * lanes at a time through lamina_fast_expf8) */
static inline void SUFFIXED(probability_grads)(REAL* p, REAL* ds, REAL L, REAL D, long n, long w) {
    long j = 0;
#if LANES == 8
    for (; j + LANES <= n; j += LANES) {
        const VEC e = lamina_fast_expf8(SUFFIXED(load)(p + j) - L), g = e * (SUFFIXED(load)(ds + j) - D);
        memcpy(p + j, &e, sizeof e);
        memcpy(ds + j, &g, sizeof g);
    }
#endif
    for (; j < n; j++) {
        p[j] = EXP(p[j] - L);
        ds[j] = p[j] * (ds[j] - D);
    }
    for (; j < w; j++) p[j] = ds[j] = 0;
}

/* The gradient of attention_head for one (sequence, head), written (not added) into dqkv's
 * head-h columns of rows [a, b): with D_i = dout_i·out_i and ds_ij = p_ij (dout_i·v_j - D_i),
 *     dq_i = scale Σ_j ds_ij k_j,   dk_j = scale Σ_i ds_ij q_i,   dv_j = Σ_i p_ij dout_i.
 * The probabilities are computed again from lse, ATTENTION_ROWS queries at a time against blocks
 * of keys, as the forward. The head's rows are gathered first into contiguous scratch (one pass
 * of independent loads, as the forward's) and its key and value gradients summed there, then
 * written out once. kt: scratch of attention_backward_scratch(n, d) values. */
LAMINA_CLONES static void SUFFIXED(attention_head_backward)(const REAL* qkv, const REAL* out, const REAL* lse,
                                                            const REAL* dout, long E, long d, long h, long heads,
                                                            long a, long b, REAL scale, int causal, REAL* dqkv,
                                                            REAL* kt) {
    const long ld = 3 * E, n = b - a, padded = (n + ATTENTION_ROWS) * d;
    REAL p[ATTENTION_ROWS][ATTENTION_BLOCK + ATTENTION_KEYS], ds[ATTENTION_ROWS][ATTENTION_BLOCK + ATTENTION_KEYS];
    REAL* vt = kt + d * n + ATTENTION_KEYS;
    REAL* queries = vt + d * n + ATTENTION_KEYS;  /* (n + ATTENTION_ROWS) x d: scaled queries, */
    REAL* grads = queries + padded;               /* their output gradients (zero rows after n), */
    REAL* keys = grads + padded;                  /* n x d: the keys, */
    REAL* dkv = keys + n * d;                     /* n x 2d: each key's and value's gradient sums, */
    REAL* dots = dkv + 2 * n * d;                 /* n: D_i, */
    REAL* dq = dots + n;                          /* ATTENTION_ROWS x d: a group's query gradients */
    SUFFIXED(transpose_head)(qkv, ld, E + h * d, a, n, d, kt);
    SUFFIXED(transpose_head)(qkv, ld, 2 * E + h * d, a, n, d, vt);
    SUFFIXED(gather_head)(qkv, E, d, h, a, n, scale, E, queries, keys);
    for (long j = 0; j < n; j++) {
        const REAL* g = dout + (a + j) * E + h * d;
        const REAL* o = out + (a + j) * E + h * d;
        REAL dot = 0;
        for (long c = 0; c < d; c++) {
            grads[j * d + c] = g[c];
            dkv[2 * j * d + c] = dkv[2 * j * d + d + c] = 0;
            dot += g[c] * o[c];
        }
        dots[j] = dot;
    }
    for (long c = 0; c < ATTENTION_ROWS * d; c++) grads[n * d + c] = 0;
    for (long i0 = 0; i0 < n; i0 += ATTENTION_ROWS) {
        const long rows = n - i0 < ATTENTION_ROWS ? n - i0 : ATTENTION_ROWS;
        const REAL *qs = queries + i0 * d, *gs = grads + i0 * d;
        for (long c = 0; c < ATTENTION_ROWS * d; c++) dq[c] = 0;
        const long end = causal ? i0 + rows : n;
        for (long j0 = 0; j0 < end; j0 += ATTENTION_BLOCK) {
            const long w = end - j0 < ATTENTION_BLOCK ? end - j0 : ATTENTION_BLOCK;
            SUFFIXED(block_scores)(qs, kt, n, d, j0, w, p);
            SUFFIXED(block_scores)(gs, vt, n, d, j0, w, ds);
            for (int r = 0; r < ATTENTION_ROWS; r++) {
                long seen = causal ? i0 + r + 1 - j0 : w;
                seen = r >= rows || seen < 0 ? 0 : (seen > w ? w : seen);
                const long i = r < rows ? i0 + r : i0;  /* (a padding row sees no key) */
                SUFFIXED(probability_grads)(p[r], ds[r], lse[(a + i) * heads + h], dots[i], seen, w);
            }
            SUFFIXED(block_values)(ds, keys + j0 * d, d, w, d, dq);
            SUFFIXED(block_key_grads)(ds, p, qs, gs, w, d, dkv + j0 * 2 * d, 2 * d, d);
        }
        for (long r = 0; r < rows; r++) {
            REAL* target = dqkv + (a + i0 + r) * ld + h * d;
            for (long c = 0; c < d; c++) target[c] = dq[r * d + c] * scale;
        }
    }
    for (long j = 0; j < n; j++) {
        REAL* target = dqkv + (a + j) * ld + E + h * d;
        for (long c = 0; c < d; c++) {
            target[c] = dkv[2 * j * d + c];
            target[E + c] = dkv[2 * j * d + d + c];
        }
    }
}
