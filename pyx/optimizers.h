/* The optimizers' element-wise updates (lamina.optim), one span of values per call: SGD (with
 * momentum, dampening, Nesterov), Adam/AdamW, AdaGrad and RMSProp, as PyTorch defines them. The
 * arithmetic is in double whatever the parameter's type, the results rounded at the store.
 * Compiled as hot loops (LAMINA_CLONES) and without errno on sqrt (setup.py: -fno-math-errno),
 * so they run in vector lanes; the loops over spans or rows are the caller's (_kernels.pyx, on
 * lamina's team). */
#ifndef LAMINA_OPTIMIZERS_H
#define LAMINA_OPTIMIZERS_H
#include <math.h>
#include "clones.h"

enum { LAMINA_SGD = 0, LAMINA_ADAM = 1, LAMINA_ADAGRAD = 2, LAMINA_RMSPROP = 3 };

/* A rule and its settings. SGD: momentum, dampening, nesterov; Adam: beta1, beta2, eps, step
 * (1-based, for the bias corrections), decoupled (AdamW: p *= 1 - lr wd, else wd p joins the
 * gradient); AdaGrad: eps; RMSProp: alpha, eps, momentum. weight_decay joins the gradient
 * (g' = g + wd p) except in AdamW. */
typedef struct {
    int rule, nesterov, decoupled;
    long step;
    double lr, momentum, dampening, beta1, beta2, eps, alpha, weight_decay;
} lamina_update_rule;

#define LAMINA_IMPL "optimizers_impl.h"
#include "instantiate.h"

#endif
