/* The planes of the depthwise convolution (pyx/_kernels.pyx): one input plane [H, W] of a channel
 * against its kernel's kh x kw taps, the output plane [oH, oW] of one output channel. Whole
 * planes per call, so the loops over rows and taps run here, and the pointers are restrict (an
 * input and an output plane never overlap) so a stride-1 row vectorises. The positions j (of n)
 * whose input column j·sw + offset lies inside the row [0, W) are [lo, hi) (lamina_dw_span). */
#ifndef LAMINA_DEPTHWISE_H
#define LAMINA_DEPTHWISE_H

#include "clones.h"
#include "epilogue.h"

static inline void lamina_dw_span(long n, long W, long sw, long offset, long *lo, long *hi) {
    *lo = offset >= 0 ? 0 : (-offset + sw - 1) / sw;
    *hi = W - 1 - offset >= 0 ? (W - 1 - offset) / sw + 1 : 0;
    if (*hi > n) *hi = n;
    if (*lo > *hi) *lo = *hi;
}

/* The forward runs on staged planes, so that its inner loop has no bounds to test and keeps a
 * block of outputs in registers across all the taps. An input plane is copied, with its padding
 * as zeros, into sh·sw phase planes: phase (r, c) holds rows r, r + sh, … and columns c, c + sw, …
 * of the padded plane, `width` columns and `rows` rows each. Tap (b, e) of output (oh, ow) reads
 * phase ((b·dh) mod sh, (e·dw) mod sw) at row oh + b·dh div sh, column ow + e·dw div sw: the
 * outputs, laid out `width` wide (columns oW and up are discarded), read every tap at one
 * constant offset from their own flat position. Each phase plane ends in one row and one block
 * of zeros more than the valid outputs reach, so a whole block of the last row stays inside. */
#define LAMINA_DW_BLOCK 32  /* a whole number of both types' blocks of four vectors */

static inline long lamina_dw_rows(long oH, long kh, long sh, long dh) { return oH + (kh - 1) * dh / sh + 1; }
static inline long lamina_dw_width(long oW, long kw, long sw, long dw) { return oW + (kw - 1) * dw / sw; }

/* the values of one phase plane, and the outputs of a plane laid out `width` wide, whole blocks */
static inline long lamina_dw_phase_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw) {
    return lamina_dw_rows(oH, kh, sh, dh) * lamina_dw_width(oW, kw, sw, dw) + LAMINA_DW_BLOCK;
}
static inline long lamina_dw_outputs_size(long oH, long oW, long kw, long sw, long dw) {
    long n = oH * lamina_dw_width(oW, kw, sw, dw);
    return (n + LAMINA_DW_BLOCK - 1) / LAMINA_DW_BLOCK * LAMINA_DW_BLOCK;
}
/* one thread's scratch for the forward (depthwise_conv): the phase planes, then the outputs */
static inline long lamina_dw_scratch_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw) {
    return sh * sw * lamina_dw_phase_size(oH, oW, kh, kw, sh, sw, dh, dw) + lamina_dw_outputs_size(oH, oW, kw, sw, dw);
}

/* one thread's scratch for the forward by channel vectors (lamina_dw_channels), 8 lanes (the
 * widest of both types): the padded span of the windows, the taps, one output row */
static inline long lamina_dw_channels_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw) {
    return (((oH - 1) * sh + (kh - 1) * dh + 1) * ((oW - 1) * sw + (kw - 1) * dw + 1) + kh * kw + (oW + 7) / 8 * 8)
           * 8;
}

/* the taps whose offsets one pass over the outputs holds */
#define LAMINA_DW_TAPS 64

#define LAMINA_IMPL "depthwise_impl.h"
#include "instantiate.h"

#define LAMINA_DEPTHWISE_PLANES(T, S)                                                                      \
    /* dx += the adjoint: each output's dy spread back, weighted, onto the inputs it read */               \
    LAMINA_CLONES static void lamina_dw_plane_back_##S(const T *restrict dy, long oH, long oW, const T *w,  \
                                                       long kh, long kw, long sh, long sw, long ph, long pw, \
                                                       long dh, long dw, T *restrict dx, long H, long W) {  \
        for (long oh = 0; oh < oH; oh++) {                                                                  \
            const T *restrict gr = dy + oh * oW;                                                            \
            for (long b = 0; b < kh; b++) {                                                                 \
                long ih = oh * sh - ph + b * dh;                                                            \
                if (ih < 0 || ih >= H) continue;                                                            \
                T *restrict xr = dx + ih * W;                                                               \
                for (long e = 0; e < kw; e++) {                                                             \
                    const T wv = w[b * kw + e];                                                             \
                    long lo, hi, off = e * dw - pw;                                                         \
                    lamina_dw_span(oW, W, sw, off, &lo, &hi);                                               \
                    if (sw == 1)                                                                            \
                        for (long j = lo; j < hi; j++) xr[j + off] += wv * gr[j];                           \
                    else                                                                                    \
                        for (long j = lo; j < hi; j++) xr[j * sw + off] += wv * gr[j];                      \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
    /* dw[tap] += Σ dy · the input the tap read, over the plane (sums in double) */                        \
    LAMINA_CLONES static void lamina_dw_plane_taps_##S(const T *restrict x, long H, long W,                 \
                                                       const T *restrict dy, long oH, long oW, long kh,     \
                                                       long kw, long sh, long sw, long ph, long pw, long dh, \
                                                       long dw, double *sums) {                            \
        for (long b = 0; b < kh; b++)                                                                       \
            for (long e = 0; e < kw; e++) {                                                                 \
                long lo, hi, off = e * dw - pw;                                                             \
                lamina_dw_span(oW, W, sw, off, &lo, &hi);                                                   \
                double s = 0;                                                                               \
                for (long oh = 0; oh < oH; oh++) {                                                          \
                    long ih = oh * sh - ph + b * dh;                                                        \
                    if (ih < 0 || ih >= H) continue;                                                        \
                    const T *xr = x + ih * W, *gr = dy + oh * oW;                                           \
                    for (long j = lo; j < hi; j++) s += (double)gr[j] * xr[j * sw + off];                   \
                }                                                                                           \
                sums[b * kw + e] += s;                                                                      \
            }                                                                                               \
    }

LAMINA_DEPTHWISE_PLANES(float, f)
LAMINA_DEPTHWISE_PLANES(double, d)

#endif
