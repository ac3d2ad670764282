/* int8 dynamic quantization of rows (the numbers of lamina.precision.quantize_rows) and the
 * scaling of an int32 product back to float32. Every value is computed in float32 with division
 * and round-to-nearest-even, as the numpy definition does, so both give the same integers. */
#ifndef LAMINA_QUANTIZE_H
#define LAMINA_QUANTIZE_H
#include <stdint.h>
#include "clones.h"

/* The scale and zero point of one row of k values: symmetric, its largest magnitude is `levels`
 * steps (zero point 0); else its range widened to hold 0 is `levels` steps. An all-zero row has
 * scale 0 (its values all quantize to the zero point). */
LAMINA_CLONES static void lamina_row_scale(const float *restrict x, long k, int levels, int symmetric,
                                           float *scale, float *zero) {
    float lo = 0.0f, hi = 0.0f;
    for (long i = 0; i < k; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
    }
    if (symmetric) {
        float top = -lo > hi ? -lo : hi;
        *scale = top / (float)levels;
        *zero = 0.0f;
    } else {
        *scale = (hi - lo) / (float)levels;
        *zero = *scale > 0.0f ? __builtin_rintf(-lo / *scale) : 0.0f;
    }
}

/* q[i] = the integer of x[i] in steps of the row's scale, less its zero point, as float */
LAMINA_CLONES static void lamina_quantize_row(const float *restrict x, long k, int levels, int symmetric,
                                              float *restrict q, float *scale) {
    float zero;
    lamina_row_scale(x, k, levels, symmetric, scale, &zero);
    const float s = *scale > 0.0f ? *scale : 1.0f, low = symmetric ? -(float)levels : 0.0f;
    for (long i = 0; i < k; i++) {
        float v = __builtin_rintf(x[i] / s) + zero;
        v = v < low ? low : (v > (float)levels ? (float)levels : v);
        q[i] = *scale > 0.0f ? v - zero : 0.0f;
    }
}

/* u[i] = the u8 value of x[i] (its steps plus the zero point, in [0, levels]), for an unsigned
 * GEMM operand; the row's scale and zero point are returned beside it */
LAMINA_CLONES static void lamina_quantize_row_u8(const float *restrict x, long k, int levels,
                                                 uint8_t *restrict u, float *scale, int32_t *zero_point) {
    float zero;
    lamina_row_scale(x, k, levels, 0, scale, &zero);
    const float s = *scale > 0.0f ? *scale : 1.0f;
    for (long i = 0; i < k; i++) {
        float v = __builtin_rintf(x[i] / s) + zero;
        v = v < 0.0f ? 0.0f : (v > (float)levels ? (float)levels : v);
        u[i] = (uint8_t)v;
    }
    *zero_point = (int32_t)zero;
}

/* One row of y = alpha-scaled int32 products back in float32:
 * y[j] = row_scale * col_scale[j] * (c[j] - zero * col_sum[j]) + (bias[j], or beta * y[j]);
 * col_sum[j] is the sum of column j's integers (the zero point's share of the product). */
LAMINA_CLONES static void lamina_dequantize_row(const int32_t *restrict c, long n, float row_scale, int32_t zero,
                                                const float *restrict col_scale, const int32_t *restrict col_sum,
                                                const float *restrict bias, float beta, float *restrict y) {
    for (long j = 0; j < n; j++) {
        float v = row_scale * col_scale[j] * (float)(c[j] - zero * col_sum[j]);
        y[j] = v + (bias ? bias[j] : (beta != 0.0f ? beta * y[j] : 0.0f));
    }
}

#endif
