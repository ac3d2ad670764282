/* The updates for the REAL type optimizers.h sets (see there). s1 and s2 are the rule's state:
 * SGD v (NULL without momentum); Adam m and v; AdaGrad the sum of squares; RMSProp the square
 * average and the momentum buffer (NULL without momentum). */

LAMINA_CLONES static void SUFFIXED(sgd_span)(const lamina_update_rule *u, REAL *restrict p, const REAL *restrict g,
                                             REAL *restrict v, long n) {
    const double lr = u->lr, momentum = u->momentum, dampening = u->dampening, wd = u->weight_decay;
    for (long i = 0; i < n; i++) {
        double gi = g[i] + wd * p[i];
        if (v) {
            const double vi = momentum * v[i] + (1 - dampening) * gi;
            v[i] = (REAL)vi;
            gi = u->nesterov ? gi + momentum * vi : vi;
        }
        p[i] = (REAL)(p[i] - lr * gi);
    }
}

LAMINA_CLONES static void SUFFIXED(adam_span)(const lamina_update_rule *u, REAL *restrict p, const REAL *restrict g,
                                              REAL *restrict m, REAL *restrict v, long n) {
    const double beta1 = u->beta1, beta2 = u->beta2, eps = u->eps, lr = u->lr, wd = u->weight_decay;
    const double step_size = lr / (1 - pow(beta1, (double)u->step));
    const double root_c2 = sqrt(1 - pow(beta2, (double)u->step));
    const double shrink = u->decoupled ? 1 - lr * wd : 1, joins = u->decoupled ? 0 : wd;
    for (long i = 0; i < n; i++) {
        const double pi = p[i] * shrink, gi = g[i] + joins * p[i];
        const double mi = beta1 * m[i] + (1 - beta1) * gi;
        const double vi = beta2 * v[i] + (1 - beta2) * gi * gi;
        m[i] = (REAL)mi;
        v[i] = (REAL)vi;
        p[i] = (REAL)(pi - step_size * mi / (sqrt(vi) / root_c2 + eps));
    }
}

LAMINA_CLONES static void SUFFIXED(adagrad_span)(const lamina_update_rule *u, REAL *restrict p,
                                                 const REAL *restrict g, REAL *restrict s, long n) {
    const double lr = u->lr, eps = u->eps, wd = u->weight_decay;
    for (long i = 0; i < n; i++) {
        const double gi = g[i] + wd * p[i], si = s[i] + gi * gi;
        s[i] = (REAL)si;
        p[i] = (REAL)(p[i] - lr * gi / (sqrt(si) + eps));
    }
}

LAMINA_CLONES static void SUFFIXED(rmsprop_span)(const lamina_update_rule *u, REAL *restrict p,
                                                 const REAL *restrict g, REAL *restrict s, REAL *restrict buf,
                                                 long n) {
    const double lr = u->lr, alpha = u->alpha, eps = u->eps, wd = u->weight_decay, momentum = u->momentum;
    for (long i = 0; i < n; i++) {
        const double gi = g[i] + wd * p[i], si = alpha * s[i] + (1 - alpha) * gi * gi;
        double step = gi / (sqrt(si) + eps);
        s[i] = (REAL)si;
        if (buf) {
            step = momentum * buf[i] + step;
            buf[i] = (REAL)step;
        }
        p[i] = (REAL)(p[i] - lr * step);
    }
}

/* one span of n values of the rule, at the same offset in every array */
static void SUFFIXED(update_span)(const lamina_update_rule *u, REAL *p, const REAL *g, REAL *s1, REAL *s2, long n) {
    switch (u->rule) {
    case LAMINA_SGD: SUFFIXED(sgd_span)(u, p, g, s1, n); break;
    case LAMINA_ADAM: SUFFIXED(adam_span)(u, p, g, s1, s2, n); break;
    case LAMINA_ADAGRAD: SUFFIXED(adagrad_span)(u, p, g, s1, n); break;
    default: SUFFIXED(rmsprop_span)(u, p, g, s1, s2, n); break;
    }
}
