/* int8 dynamic quantization of rows (the numbers of lamina.precision.quantize_rows) and the
 * scaling of an int32 product back to float32. Every value is computed in float32 with division
 * and round-to-nearest-even, as the numpy definition does, so both give the same integers. */
#ifndef LAMINA_QUANTIZE_H
#define LAMINA_QUANTIZE_H
#include <stdint.h>
#include <string.h>
#include "clones.h"

/* 4 floats and 4 ints, SSE's width: four of them in flight make 16 lanes, which every clone
 * runs at full speed (a generic vector wider than the clone's registers is split badly) */
typedef float lamina_f4v __attribute__((vector_size(16)));
typedef int32_t lamina_i4v __attribute__((vector_size(16)));
#define LAMINA_QUANTIZE_LANES 16

/* The scale and zero point of one row of k values: symmetric, its largest magnitude is `levels`
 * steps (zero point 0); else its range widened to hold 0 is `levels` steps. An all-zero row has
 * scale 0 (its values all quantize to the zero point); a row holding NaN or infinity (all
 * exponent bits set) has scale NaN, so every product of it is NaN. */
LAMINA_CLONES static void lamina_row_scale(const float *restrict x, long k, int levels, int symmetric,
                                           float *scale, float *zero) {
    lamina_f4v lo[4] = {{0}}, hi[4] = {{0}};
    lamina_i4v special = {0};
    long i = 0;
    for (; i + LAMINA_QUANTIZE_LANES <= k; i += LAMINA_QUANTIZE_LANES) {
        for (int r = 0; r < 4; r++) {
            lamina_f4v v;
            lamina_i4v bits;
            memcpy(&v, x + i + 4 * r, sizeof v);
            memcpy(&bits, x + i + 4 * r, sizeof bits);
            const lamina_i4v below = v < lo[r], above = v > hi[r];
            lo[r] = (lamina_f4v)((below & (lamina_i4v)v) | (~below & (lamina_i4v)lo[r]));
            hi[r] = (lamina_f4v)((above & (lamina_i4v)v) | (~above & (lamina_i4v)hi[r]));
            special |= (bits & 0x7f800000) == 0x7f800000;
        }
    }
    float los[LAMINA_QUANTIZE_LANES], his[LAMINA_QUANTIZE_LANES], low = 0.0f, high = 0.0f;
    int32_t specials[4], nonfinite = 0;
    memcpy(los, lo, sizeof los);
    memcpy(his, hi, sizeof his);
    memcpy(specials, &special, sizeof specials);
    for (int j = 0; j < LAMINA_QUANTIZE_LANES; j++) {
        low = los[j] < low ? los[j] : low;
        high = his[j] > high ? his[j] : high;
    }
    for (int j = 0; j < 4; j++)
        nonfinite |= specials[j];
    for (; i < k; i++) {
        uint32_t bits;
        memcpy(&bits, x + i, 4);
        low = x[i] < low ? x[i] : low;
        high = x[i] > high ? x[i] : high;
        nonfinite |= (bits & 0x7f800000u) == 0x7f800000u;
    }
    if (symmetric) {
        const float top = -low > high ? -low : high;
        *scale = top / (float)levels;
        *zero = 0.0f;
    } else {
        *scale = (high - low) / (float)levels;
        *zero = *scale > 0.0f ? __builtin_rintf(-low / *scale) : 0.0f;
    }
    if (nonfinite) *scale = __builtin_nanf("");
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

/* y[i] = x[i] as its row's grid holds it: its integer (less the zero point) times the scale
 * (lamina.precision.quantize_rows), in float32; a row holding NaN or infinity becomes NaN. The
 * left operand of a float32 product that computes an int8 one */
LAMINA_CLONES static void lamina_snap_row(const float *x, long k, int levels, int symmetric, float *y) {
    float scale;
    lamina_quantize_row(x, k, levels, symmetric, y, &scale);
    for (long i = 0; i < k; i++)
        y[i] *= scale;
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
        v = v > 0.0f ? v : 0.0f;  /* (a NaN becomes 0: the conversion below is then defined) */
        v = v < (float)levels ? v : (float)levels;
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
