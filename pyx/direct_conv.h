/* Direct convolution (no column matrix) for window rows with unit stride along the width, in
 * float and double: y[co, od, oh, ow] = sum over ci and taps of w · x_padded. Each tile of output
 * is 4 output channels x 2 vectors of adjacent widths held in registers while every input
 * channel and tap passes over it: per tap two loads of the input row, four broadcast weights,
 * eight fused multiply-adds (eight independent sums cover the FMA latency); the weights come
 * pre-packed in the order they are read [channel block][ci][kd][kh][kw][4]. Blocks of 4 channels
 * leave no empty lanes for the usual channel counts (6 were slower). The caller pads the input (zeros around it, and a vector's
 * worth past each row end so the last tile's loads stay inside the row). Compiled for AVX2 + FMA
 * and the baseline (clones.h). */
#ifndef LAMINA_DIRECT_CONV_H
#define LAMINA_DIRECT_CONV_H

#include <string.h>
#include "clones.h"
#include "epilogue.h"
#include "team.h"

#define LAMINA_CO_BLOCK 4
/* The weight gradient's tile: LAMINA_DW_CO_BLOCK output channels x up to 3 taps of sums, three
 * input vectors and a gradient vector held in registers: 3 channels (nine sums) in AVX2's sixteen
 * (with 4, one sum spilled to the stack every iteration), 8 channels (24 sums) in AVX-512's
 * thirty-two. */
#define LAMINA_DW_MAX_KW 3
#if defined(LAMINA_TARGET_V4)
#define LAMINA_DW_CO_BLOCK 8
#else
#define LAMINA_DW_CO_BLOCK 3
#endif

/* Every sample of a batch on a team (team.h, direct_batch_member_f or _d), each member taking runs
 * of samples no member has taken (lamina_claim_run): the sample [C, D, H, W] (at x + n·x_stride) padded into the
 * member's own copy (xp[t]: direct_pad), then direct_conv_groups into y + n·y_stride
 * [cout, oD, oH, oW]; strides and sizes in values of the member's type. */
typedef struct {
    const void *x, *packed, *bias;
    const long *geo;
    void *const *xp;
    void *y;
    long N, x_stride, y_stride, C, D, H, W, Dp, Hp, Wp, pd, ph, pw, cout, oD, oH, oW, next;
    int groups, relu, accumulate, pool_depth;
} lamina_direct_batch;

#define LAMINA_IMPL "direct_conv_impl.h"
#include "instantiate.h"
#define LAMINA_IMPL "direct_dw_impl.h"
#include "instantiate.h"

/* In the AVX-512 build the float weight gradient also runs on vectors of 16 widths
 * (direct_conv_dw_f16): FMAs on 512-bit vectors do twice the work of 256-bit ones at the same rate
 * on CPUs with two 512-bit FMA units (Intel Xeon, AMD Zen 5). LAMINA_DW_WIDE_LANES: its widths, 0
 * where it is not built (direct_conv_dw_f16 then names the 8-wide kernel, never called). */
#if defined(LAMINA_TARGET_V4)
typedef float lamina_v16f __attribute__((vector_size(64)));
#define LAMINA_DW_WIDE_LANES 16
#define REAL float
#define VEC lamina_v16f
#define LANES 16
#define SUFFIXED(name) SUFFIXED2(name, f16)
#include "direct_dw_impl.h"
#undef REAL
#undef VEC
#undef LANES
#undef SUFFIXED
#else
#define LAMINA_DW_WIDE_LANES 0
#define direct_conv_dw_f16 direct_conv_dw_f
#endif

#endif
