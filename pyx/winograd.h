/* Winograd convolution F(2, 3) along each axis of a stride-1, dilation-1 kernel of 3: F(2x2x2,
 * 3x3x3) for volumes (64 products per 2x2x2 outputs where the direct form needs 216) and
 * F(2x2, 3x3) for images (16 where direct needs 36). With the 1-D transforms
 *     Bᵀ = [1 0 -1 0; 0 1 1 0; 0 -1 1 0; 0 1 0 -1]   (input tile d of 4)
 *     G  = [1 0 0; ½ ½ ½; ½ -½ ½; 0 0 1]              (kernel g of 3, done by the caller)
 *     Aᵀ = [1 1 1 0; 0 1 -1 -1]                       (back to 2 outputs)
 * applied along every axis, y = Aᵀ[(G g Gᵀ) ⊙ (Bᵀ d B)]A sums over input channels inside the
 * transform domain: for each of the XI = 4^axes points ξ, M_ξ [tiles x Cout] = V_ξ [tiles x Cin]
 * · U_ξ [Cin x Cout], a GEMM (panels.h, U_ξ panel-packed once per weight version).
 *
 * Layouts (channel counts padded to whole vectors with zeros, Cp and COp):
 *   xcl  the input padded and channels-last [Dp][Hp][Wp][Cp]; tile t reads the 4x4(x4) block
 *        from (2·td, 2·th, 2·tw) (depth td when the kernel has depth 1)
 *   V    [T][XI][Cp] for a block of T tiles, M [T][XI][COp]: a tile's points are adjacent, so
 *        the transforms read and write them in order; the GEMM of point ξ steps over tiles
 *        with a leading dimension of lamina_wino_tile_stride(XI, Cp) (of COp for M)
 * A block of tiles keeps V and M in cache between the transforms and the products. Vectors run
 * along channels, so every transform is whole-vector adds. Compiled for AVX2 + FMA and the
 * baseline (clones.h). */
#ifndef LAMINA_WINOGRAD_H
#define LAMINA_WINOGRAD_H

#include <stdlib.h>
#include <string.h>
#include "clones.h"
#include "epilogue.h"
#include "panels.h"
#include "team.h"

/* Every sample of a batch on a team (team.h, wino_batch_member_f or _d): each member takes runs
 * of samples no member has taken (lamina_claim_run), pads each into its own xcl and transforms it
 * in its own V and M (member t's: xcl[t], V[t], M[t]); or, with split set (for a batch smaller
 * than the team), the members share each sample's padding and then its rows of tiles, in one xcl
 * (xcl[0]). Samples at x + n·x_stride and y + n·y_stride (in values of the member's type). The
 * counters (next, pad_next, padded, rows_done) start at 0. */
typedef struct {
    const void *x, *packed, *bias;
    void *const *xcl, *const *V, *const *M;
    void *y;
    long N, x_stride, y_stride, C, D, H, W, pd, ph, pw, Cp, Dp, Hp, Wp, TD, TH, TW, COp, cout, T, oD, oH, oW;
    long next, pad_next, padded, rows_done;
    int depth3, relu, accumulate, pool, split;
} lamina_wino_batch;

/* Values from one tile to the next in V (channels Cp) or M (channels COp): a tile's XI points
 * and 64 bytes more. The GEMM of a point reads (writes) the rows of six tiles at once; at XI·Cp
 * values apart (4 KB for 16 float channels, 64 points) those rows would all share one L1 set. */
static inline long lamina_wino_tile_stride(long XI, long channels, long value_size) {
    return XI * channels + 64 / value_size;
}

#define LAMINA_IMPL "winograd_impl.h"
#include "instantiate.h"

#endif
