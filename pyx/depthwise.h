/* The planes of the depthwise convolution (pyx/_kernels.pyx): one input plane [H, W] of a channel
 * against its kernel's kh x kw taps, the output plane [oH, oW] of one output channel. Whole
 * planes per call, so the loops over rows and taps run here, and the pointers are restrict (an
 * input and an output plane never overlap) so a stride-1 row vectorises. The output positions
 * ow whose input column ow·sw + offset lies inside the row are [lo, hi) (lamina_dw_span). */
#ifndef LAMINA_DEPTHWISE_H
#define LAMINA_DEPTHWISE_H

#include "clones.h"

static inline void lamina_dw_span(long oW, long W, long sw, long offset, long *lo, long *hi) {
    *lo = offset >= 0 ? 0 : (-offset + sw - 1) / sw;
    *hi = W - 1 - offset >= 0 ? (W - 1 - offset) / sw + 1 : 0;
    if (*hi > oW) *hi = oW;
    if (*lo > *hi) *lo = *hi;
}

#define LAMINA_DEPTHWISE_PLANES(T, S)                                                                      \
    /* y += the 2-D convolution of x with w [kh·kw] (y initialised by the caller) */                      \
    LAMINA_CLONES static void lamina_dw_plane_##S(const T *restrict x, long H, long W, const T *w, long kh, \
                                                  long kw, long sh, long sw, long ph, long pw, long dh,    \
                                                  long dw, T *restrict y, long oH, long oW) {              \
        for (long oh = 0; oh < oH; oh++) {                                                                  \
            T *restrict yr = y + oh * oW;                                                                   \
            for (long b = 0; b < kh; b++) {                                                                 \
                long ih = oh * sh - ph + b * dh;                                                            \
                if (ih < 0 || ih >= H) continue;                                                            \
                const T *restrict xr = x + ih * W;                                                          \
                for (long e = 0; e < kw; e++) {                                                             \
                    const T wv = w[b * kw + e];                                                             \
                    long lo, hi, off = e * dw - pw;                                                         \
                    lamina_dw_span(oW, W, sw, off, &lo, &hi);                                               \
                    if (sw == 1)                                                                            \
                        for (long j = lo; j < hi; j++) yr[j] += wv * xr[j + off];                           \
                    else                                                                                    \
                        for (long j = lo; j < hi; j++) yr[j] += wv * xr[j * sw + off];                      \
                }                                                                                           \
            }                                                                                               \
        }                                                                                                   \
    }                                                                                                       \
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
