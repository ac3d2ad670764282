/* Softmax over rows, in float (fast exp, vectorised) and double (libm exp). */
#ifndef LAMINA_SOFTMAX_H
#define LAMINA_SOFTMAX_H
#include <math.h>
#include <string.h>
#include "clones.h"

/* e^x for x = n ln2 + r, |r| <= ln2/2, written once for a float and for an 8-lane vector (the
 * same operations on either): r with ln2 split in two for an exact reduction, then e^r by
 * Cephes' degree-7 polynomial */
#define LAMINA_EXPF_REMAINDER(x, n) ((x) - (n) * 0.693359375f + (n) * 2.12194440e-4f)
#define LAMINA_EXPF_POLYNOMIAL(r)                                                                      \
    ((((((1.9875691500e-4f * (r) + 1.3981999507e-3f) * (r) + 8.3334519073e-3f) * (r) + 4.1665795894e-2f) \
       * (r) + 1.6666665459e-1f) * (r) + 5.0000001201e-1f) * (r) * (r) + (r) + 1.0f)

/* Fast float32 exp for x <= 88: x = n ln2 + r, e^r by the polynomial above, 2^n put into the
 * exponent bits. Within 2 ulp of expf; x below -87.3 gives e^-87.3 (about 1e-38) instead of
 * smaller values or 0; NaN stays NaN. Multiply-adds, a rounding and integer bit work, so loops
 * using it vectorise, where libm's expf is a scalar call. */
static inline float lamina_fast_expf(float x) {
    x = x < -87.33654475f ? -87.33654475f : x;
    const float n = __builtin_rintf(x * 1.44269504088896341f), r = LAMINA_EXPF_REMAINDER(x, n);
    const int bits = ((int)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return LAMINA_EXPF_POLYNOMIAL(r) * scale;
}

#define LAMINA_IMPL "softmax_impl.h"
#include "instantiate.h"

/* lamina_fast_expf on 8 lanes at once, with the same steps and constants: the rounding to the
 * nearest integer by adding and subtracting 1.5 * 2^23 (exact for the |n| <= 128 a clamped x
 * gives), so it needs no rounding instruction and compiles for any target. NaN lanes stay NaN. */
static inline __attribute__((always_inline)) lamina_v8f lamina_fast_expf8(lamina_v8f x) {
    const lamina_v8f low = (lamina_v8f){0} - 87.33654475f;
    const lamina_v8i below = (lamina_v8i)(x < low);
    x = (lamina_v8f)(((lamina_v8i)low & below) | ((lamina_v8i)x & ~below));
    const lamina_v8f n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f, r = LAMINA_EXPF_REMAINDER(x, n);
    const lamina_v8i bits = (__builtin_convertvector(n, lamina_v8i) + 127) << 23;
    return LAMINA_EXPF_POLYNOMIAL(r) * (lamina_v8f)bits;
}

#endif
