/* Included by instantiate.h once per element type (REAL, LANES, EXP, SUFFIXED). */

/* One row of n values: y = softmax(x), or with take_log its log, x - max - log Σ exp(x - max).
 * Returns the row's log-sum-exp, max + log Σ exp(x - max), in double. The maximum and the sum
 * run in LANES independent lanes (a single running value is a chain the compiler may not
 * reorder), the sum in double, so every pass vectorises. y may be x; y NULL: the log-sum-exp
 * alone, x only read (a cross-entropy score at inference needs no probabilities). */
LAMINA_CLONES static double SUFFIXED(softmax_row)(const REAL* x, REAL* y, long n, int take_log) {
    REAL top[LANES];
    double acc[LANES];
    long j = 0, whole = n - n % LANES;
    for (int l = 0; l < LANES; l++) top[l] = x[0];
    for (; j < whole; j += LANES)
        for (int l = 0; l < LANES; l++) top[l] = x[j + l] > top[l] ? x[j + l] : top[l];
    REAL m = top[0];
    for (int l = 1; l < LANES; l++) m = top[l] > m ? top[l] : m;
    for (; j < n; j++) m = x[j] > m ? x[j] : m;
    for (int l = 0; l < LANES; l++) acc[l] = 0;
    if (!y)
        for (j = 0; j < whole; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += (double)EXP(x[j + l] - m);
    else
        for (j = 0; j < whole; j += LANES)
            for (int l = 0; l < LANES; l++) {
                REAL e = EXP(x[j + l] - m);
                if (!take_log) y[j + l] = e;
                acc[l] += (double)e;
            }
    double s = 0;
    for (int l = 0; l < LANES; l++) s += acc[l];
    for (; j < n; j++) {
        REAL e = EXP(x[j] - m);
        if (y && !take_log) y[j] = e;
        s += (double)e;
    }
    double lse = (double)m + log(s);
    if (!y)
        return lse;
    if (take_log) {
        for (j = 0; j < n; j++) y[j] = (REAL)((double)x[j] - lse);
    } else {
        REAL inv = (REAL)(1.0 / s);
        for (j = 0; j < n; j++) y[j] *= inv;
    }
    return lse;
}
