/* Recurrent cells, one row at a time, in float (fast tanh) and double (libm tanh). */
#ifndef LAMINA_CELLS_H
#define LAMINA_CELLS_H
#include <math.h>
#include "clones.h"

/* Fast float32 tanh: Eigen's rational approximation (odd degree-13 numerator, degree-6
 * denominator), within 4e-7 of tanh over the float range; multiply-adds and one division, so
 * loops using it vectorise, where libm's tanhf is a scalar call. float64 keeps libm's tanh. */
static inline float lamina_fast_tanhf(float x) {
    const float clamp = 7.90531110763549805f;
    x = x > clamp ? clamp : x;
    x = x < -clamp ? -clamp : x;
    float x2 = x * x;
    float p = x2 * -2.76076847742355e-16f + 2.00018790482477e-13f;
    p = x2 * p + -8.60467152213735e-11f;
    p = x2 * p + 5.12229709037114e-08f;
    p = x2 * p + 1.48572235717979e-05f;
    p = x2 * p + 6.37261928875436e-04f;
    p = x2 * p + 4.89352455891786e-03f;
    p = x * p;
    float q = x2 * 1.19825839466702e-06f + 1.18534705686654e-04f;
    q = x2 * q + 2.26843463243900e-03f;
    q = x2 * q + 4.89352518554385e-03f;
    return p / q;
}

/* pass(args..., with_bias, with_prev) with both flags as constants: each of the four instances
 * inlines a loop without conditional loads, which gcc vectorises (a loop testing the pointers
 * for NULL at each unit stays scalar). */
#define LAMINA_SPECIALISED(pass, bias, prev, ...)                                   \
    ((bias) ? ((prev) ? pass(__VA_ARGS__, 1, 1) : pass(__VA_ARGS__, 1, 0))          \
            : ((prev) ? pass(__VA_ARGS__, 0, 1) : pass(__VA_ARGS__, 0, 0)))

#define LAMINA_IMPL "cells_impl.h"
#include "instantiate.h"

#endif
