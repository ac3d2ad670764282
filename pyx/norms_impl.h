/* Included by instantiate.h once per element type (REAL, LANES, SUFFIXED).
 *
 * A row x of n values: μ its mean, rstd = 1 / sqrt(mean((x - μ)²) + eps), x̂ = (x - μ) rstd,
 * y = x̂ γ + β. Without centring (RMSNorm) μ = 0 and there is no β. γ or β NULL: absent (1, 0).
 * Sums run in LANES double accumulators, so the loops vectorise. */

LAMINA_CLONES static void SUFFIXED(layer_norm_row)(const REAL* x, long n, double eps, int center, const REAL* gamma,
                                                   const REAL* beta, REAL* y, REAL* mean, REAL* rstd) {
    double acc[LANES];
    long j, whole = n - n % LANES;
    double mu = 0;
    if (center) {
        for (int l = 0; l < LANES; l++) acc[l] = 0;
        for (j = 0; j < whole; j += LANES)
            for (int l = 0; l < LANES; l++) acc[l] += (double)x[j + l];
        for (j = whole; j < n; j++) acc[0] += (double)x[j];
        for (int l = 0; l < LANES; l++) mu += acc[l];
        mu /= (double)n;
    }
    for (int l = 0; l < LANES; l++) acc[l] = 0;
    for (j = 0; j < whole; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const double c = (double)x[j + l] - mu;
            acc[l] += c * c;
        }
    for (j = whole; j < n; j++) acc[0] += ((double)x[j] - mu) * ((double)x[j] - mu);
    double var = 0;
    for (int l = 0; l < LANES; l++) var += acc[l];
    const double r = 1.0 / sqrt(var / (double)n + eps);
    const REAL m = (REAL)mu, s = (REAL)r;
    for (j = 0; j < n; j++) {
        REAL v = (x[j] - m) * s;
        if (gamma) v *= gamma[j];
        if (beta) v += beta[j];
        y[j] = v;
    }
    *mean = m;
    *rstd = s;
}

/* dx of one row, written with beta: with g = dy γ,
 *     dx = rstd (g - mean(g) - x̂ mean(g x̂))    (without centring: no mean(g) term). */
LAMINA_CLONES static void SUFFIXED(layer_norm_row_backward)(const REAL* x, const REAL* dy, long n, REAL mean,
                                                            REAL rstd, int center, const REAL* gamma, REAL* dx,
                                                            double beta) {
    double sg[LANES], sgx[LANES];
    long j, whole = n - n % LANES;
    for (int l = 0; l < LANES; l++) sg[l] = sgx[l] = 0;
    for (j = 0; j < whole; j += LANES)
        for (int l = 0; l < LANES; l++) {
            const REAL g = gamma ? dy[j + l] * gamma[j + l] : dy[j + l];
            sg[l] += (double)g;
            sgx[l] += (double)(g * ((x[j + l] - mean) * rstd));
        }
    for (j = whole; j < n; j++) {
        const REAL g = gamma ? dy[j] * gamma[j] : dy[j];
        sg[0] += (double)g;
        sgx[0] += (double)(g * ((x[j] - mean) * rstd));
    }
    double m1 = 0, m2 = 0;
    for (int l = 0; l < LANES; l++) {
        m1 += sg[l];
        m2 += sgx[l];
    }
    const REAL a = center ? (REAL)(m1 / (double)n) : 0, c = (REAL)(m2 / (double)n);
    for (j = 0; j < n; j++) {
        const REAL g = gamma ? dy[j] * gamma[j] : dy[j];
        const REAL v = rstd * (g - a - (x[j] - mean) * rstd * c);
        dx[j] = beta == 0 ? v : (REAL)(v + beta * dx[j]);
    }
}

/* dγ[j] = Σ_rows dy x̂ and dβ[j] = Σ_rows dy for columns j0 .. j1 (at most NORM_CHUNK of them),
 * each written with its beta; dgamma or dbeta NULL: not wanted. */
LAMINA_CLONES static void SUFFIXED(layer_norm_param_grads)(const REAL* x, const REAL* dy, const REAL* mean,
                                                           const REAL* rstd, long rows, long n, long j0, long j1,
                                                           REAL* dgamma, double gamma_beta, REAL* dbeta,
                                                           double beta_beta) {
    double ag[NORM_CHUNK], ab[NORM_CHUNK];
    const long w = j1 - j0;
    for (long j = 0; j < w; j++) ag[j] = ab[j] = 0;
    for (long i = 0; i < rows; i++) {
        const REAL* xr = x + i * n + j0;
        const REAL* gr = dy + i * n + j0;
        const REAL m = mean[i], s = rstd[i];
        for (long j = 0; j < w; j++) {
            ag[j] += (double)(gr[j] * ((xr[j] - m) * s));
            ab[j] += (double)gr[j];
        }
    }
    for (long j = 0; j < w; j++) {
        if (dgamma) dgamma[j0 + j] = gamma_beta == 0 ? (REAL)ag[j] : (REAL)(ag[j] + gamma_beta * dgamma[j0 + j]);
        if (dbeta) dbeta[j0 + j] = beta_beta == 0 ? (REAL)ab[j] : (REAL)(ab[j] + beta_beta * dbeta[j0 + j]);
    }
}
