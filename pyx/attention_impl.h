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

static void SUFFIXED(transpose_head)(const REAL* qkv, long ld, long col, long a, long n, long d, REAL* t) {
    for (long j = 0; j < n; j++) {
        const REAL* row = qkv + (a + j) * ld + col;
        for (long c = 0; c < d; c++) t[c * n + j] = row[c];
    }
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

/* out and lse (one value per row and head, [rows, heads]) of one (sequence, head); keys in
 * blocks of ATTENTION_BLOCK, the block's scores rescaling the running sum and output whenever
 * the running maximum rises */
LAMINA_CLONES static void SUFFIXED(attention_head)(const REAL* qkv, long E, long d, long h, long heads, long a,
                                                   long b, REAL scale, int causal, REAL* out, REAL* lse, REAL* kt) {
    const long ld = 3 * E, n = b - a;
    REAL s[ATTENTION_BLOCK];
    SUFFIXED(transpose_head)(qkv, ld, E + h * d, a, n, d, kt);
    for (long i = 0; i < n; i++) {
        const REAL* q = qkv + (a + i) * ld + h * d;
        REAL* o = out + (a + i) * E + h * d;
        const long end = causal ? i + 1 : n;
        REAL m = -INFINITY, l = 0;
        for (long c = 0; c < d; c++) o[c] = 0;
        for (long j0 = 0; j0 < end; j0 += ATTENTION_BLOCK) {
            const long w = end - j0 < ATTENTION_BLOCK ? end - j0 : ATTENTION_BLOCK;
            SUFFIXED(head_scores)(q, scale, kt, n, d, j0, w, s);
            REAL top = s[0];
            for (long j = 1; j < w; j++) top = s[j] > top ? s[j] : top;
            if (top > m) {
                const REAL f = m == -INFINITY ? 0 : EXP(m - top);
                l *= f;
                for (long c = 0; c < d; c++) o[c] *= f;
                m = top;
            }
            for (long j = 0; j < w; j++) s[j] = EXP(s[j] - m);
            for (long j = 0; j < w; j++) {
                const REAL* v = qkv + (a + j0 + j) * ld + 2 * E + h * d;
                const REAL p = s[j];
                l += p;
                for (long c = 0; c < d; c++) o[c] += p * v[c];
            }
        }
        const REAL inv = 1 / l;
        for (long c = 0; c < d; c++) o[c] *= inv;
        lse[(a + i) * heads + h] = m + (REAL)log((double)l);
    }
}

/* The gradient of attention_head for one (sequence, head), written (not added) into dqkv's
 * head-h columns of rows [a, b): with D_i = dout_i·out_i and ds_ij = p_ij (dout_i·v_j - D_i),
 *     dq_i = scale Σ_j ds_ij k_j,   dk_j = scale Σ_i ds_ij q_i,   dv_j = Σ_i p_ij dout_i.
 * The probabilities are computed again from lse. */
LAMINA_CLONES static void SUFFIXED(attention_head_backward)(const REAL* qkv, const REAL* out, const REAL* lse,
                                                            const REAL* dout, long E, long d, long h, long heads,
                                                            long a, long b, REAL scale, int causal, REAL* dqkv,
                                                            REAL* kt, REAL* vt) {
    const long ld = 3 * E, n = b - a;
    REAL p[ATTENTION_BLOCK], dp[ATTENTION_BLOCK];
    SUFFIXED(transpose_head)(qkv, ld, E + h * d, a, n, d, kt);
    SUFFIXED(transpose_head)(qkv, ld, 2 * E + h * d, a, n, d, vt);
    for (long j = 0; j < n; j++) {
        REAL* dk = dqkv + (a + j) * ld + E + h * d;
        for (long c = 0; c < d; c++) dk[c] = dk[E + c] = 0;
    }
    for (long i = 0; i < n; i++) {
        const long r = a + i, end = causal ? i + 1 : n;
        const REAL* q = qkv + r * ld + h * d;
        const REAL* o = out + r * E + h * d;
        const REAL* g = dout + r * E + h * d;
        REAL* dq = dqkv + r * ld + h * d;
        const REAL L = lse[r * heads + h];
        REAL D = 0;
        for (long c = 0; c < d; c++) D += g[c] * o[c];
        for (long c = 0; c < d; c++) dq[c] = 0;
        for (long j0 = 0; j0 < end; j0 += ATTENTION_BLOCK) {
            const long w = end - j0 < ATTENTION_BLOCK ? end - j0 : ATTENTION_BLOCK;
            SUFFIXED(head_scores)(q, scale, kt, n, d, j0, w, p);
            SUFFIXED(head_scores)(g, 1, vt, n, d, j0, w, dp);
            for (long j = 0; j < w; j++) p[j] = EXP(p[j] - L);
            for (long j = 0; j < w; j++) {
                const long kr = a + j0 + j;
                const REAL* k = qkv + kr * ld + E + h * d;
                REAL* dk = dqkv + kr * ld + E + h * d;
                REAL* dv = dk + E;
                const REAL ds = p[j] * (dp[j] - D) * scale, pj = p[j];
                for (long c = 0; c < d; c++) {
                    dq[c] += ds * k[c];
                    dk[c] += ds * q[c];
                    dv[c] += pj * g[c];
                }
            }
        }
    }
}
