/* Vectorised float32 forms of the activations built on erf and tanh (GELU, its tanh
 * approximation, erf itself), for spans of a flat array. */
#ifndef LAMINA_ACTIVATIONS_H
#define LAMINA_ACTIVATIONS_H
#include <math.h>
#include "cells.h"
#include "clones.h"
#include "softmax.h"

/* erf(x) as 1 - erfc(|x|), the sign restored, with erfc from Numerical Recipes' Chebyshev fit
 * (relative error below 1.2e-7): computed in float32, within 3.8e-7 of erf(x) absolutely everywhere
 * (measured against libm's double erf at every 7e-7 over [-9, 9]; 1 - erfc near 0 is where float32
 * rounds), which is what GELU needs (it adds erf to 1), not relatively near 0. NaN stays NaN. erfc is taken at min(|x|, 9): erfc(9)
 * is 4e-37 and 1 - erfc rounds to 1 from there on, while a larger |x| would make its exp's
 * product a subnormal float, which the CPU computes many times slower. */
static inline float lamina_erf_from_erfc(float x) {
    const float z = fabsf(x) < 9.0f ? fabsf(x) : 9.0f, zz = z * z;
    const float t = 1.0f / (1.0f + 0.5f * z);
    float p = 0.17087277f;
    p = p * t - 0.82215223f;
    p = p * t + 1.48851587f;
    p = p * t - 1.13520398f;
    p = p * t + 0.27886807f;
    p = p * t - 0.18628806f;
    p = p * t + 0.09678418f;
    p = p * t + 0.37409196f;
    p = p * t + 1.00002368f;
    const float tail = 1.0f - t * lamina_fast_expf(-zz - 1.26551223f + p * t);
    return x < 0 ? -tail : (x == x ? tail : x);
}

/* erf(x) in float32 within 3e-7, relatively too: for |x| < 0.5 its Taylor series to x^13 (the
 * rest below 1e-9), above lamina_erf_from_erfc. Both are computed and one selected, so loops
 * vectorise. */
static inline float lamina_fast_erff(float x) {
    const float s = x * x;
    float taylor = 1.0f / 9360;
    taylor = taylor * s - 1.0f / 1320;
    taylor = taylor * s + 1.0f / 216;
    taylor = taylor * s - 1.0f / 42;
    taylor = taylor * s + 1.0f / 10;
    taylor = taylor * s - 1.0f / 3;
    taylor = (taylor * s + 1.0f) * x * 1.1283791670955126f;
    const float far = lamina_erf_from_erfc(x);
    return fabsf(x) < 0.5f ? taylor : far;
}

/* activation kinds of these spans: the codes of lamina.backends.base.ACTIVATIONS */
#define LAMINA_GELU 11
#define LAMINA_GELU_TANH 13
#define LAMINA_ERF 19

static inline float lamina_gelu_tanh_inner(float x) {
    return 0.7978845608028654f * (x + 0.044715f * x * x * x);
}

/* y = f(x) over n values (y may be x) */
LAMINA_CLONES static void lamina_erf_activation_f(int kind, const float* x, float* y, long n) {
    if (kind == LAMINA_GELU)  /* (1 + erf: erf's absolute error is what counts) */
        for (long i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + lamina_erf_from_erfc(x[i] * 0.7071067811865476f));
    else if (kind == LAMINA_GELU_TANH)
        for (long i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + lamina_fast_tanhf(lamina_gelu_tanh_inner(x[i])));
    else
        for (long i = 0; i < n; i++) y[i] = lamina_fast_erff(x[i]);
}

/* f'(x) of each kind */
static inline float lamina_gelu_grad(float v) {
    return 0.5f * (1.0f + lamina_erf_from_erfc(v * 0.7071067811865476f)) +
           v * lamina_fast_expf(-0.5f * v * v) * 0.3989422804014327f;
}

static inline float lamina_gelu_tanh_grad(float v) {
    const float t = lamina_fast_tanhf(lamina_gelu_tanh_inner(v));
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);
}

static inline float lamina_erf_grad(float v) {
    return 1.1283791670955126f * lamina_fast_expf(-v * v);
}

/* dx = dy f'(x) + beta dx over n values (beta 0 never reads dx): one loop per kind and beta, so
 * each vectorises */
#define LAMINA_GRAD_LOOP(grad)                                                  \
    do {                                                                        \
        if (beta == 0)                                                          \
            for (long i = 0; i < n; i++) dx[i] = dy[i] * grad(x[i]);            \
        else                                                                    \
            for (long i = 0; i < n; i++) dx[i] = dy[i] * grad(x[i]) + beta * dx[i]; \
    } while (0)

LAMINA_CLONES static void lamina_erf_activation_grad_f(int kind, const float* x, const float* dy, float* dx, long n,
                                                       float beta) {
    if (kind == LAMINA_GELU)
        LAMINA_GRAD_LOOP(lamina_gelu_grad);
    else if (kind == LAMINA_GELU_TANH)
        LAMINA_GRAD_LOOP(lamina_gelu_tanh_grad);
    else
        LAMINA_GRAD_LOOP(lamina_erf_grad);
}

#endif
