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
#define LAMINA_DW_MAX_KW 3
#define LAMINA_DW_CO_BLOCK 3

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

#endif
