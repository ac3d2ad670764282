/* vol2col and col2vol for one channel of a volume (float and double), called per channel from
 * lamina._kernels (which spreads the channels over the threads).
 *
 * A row of the column matrix over one window row is a strided run of an input row: contiguous
 * for stride 1, every other value for stride 2 (a transposed convolution's usual stride, whose
 * backward gathers the output gradient this way and whose forward scatters into its output).
 * Both are compiled for AVX2 + FMA (clones.h), and stride 2 moves two vectors at a time through a
 * shuffle instead of one value at a time (one at a time, these loops were a large share of a
 * transposed convolution's training step). A scatter with width stride 2 adds all the kw taps of
 * a window row in one read-add-write of the row. */
#ifndef LAMINA_VOLUMES_H
#define LAMINA_VOLUMES_H

#include <string.h>
#include "clones.h"
#include "epilogue.h"

/* window columns ow in [lo, hi) whose input column ow·s + off lies in [0, W) */
static inline void lamina_valid_range(long oW, long W, long s, long off, long *lo, long *hi) {
    *lo = off >= 0 ? 0 : (-off + s - 1) / s;
    *hi = W - 1 - off < 0 ? 0 : (W - 1 - off) / s + 1;
    if (*hi > oW) *hi = oW;
    if (*lo > *hi) *lo = *hi;
}

/* Window rows are walked in chunks of about this many column values, every tap over one chunk
 * before the next, so that the input rows a chunk reads (or adds into) stay in L1 across the
 * taps instead of being streamed from L2 once per tap. */
#define WALK_CHUNK_VALUES 256

/* Asks the cache for the input rows that window rows [r0, r1) of an oD x oH grid read (or add
 * into), x [D][H][W] of `size`-byte values, a line at a time (into L2; for writing where
 * `write`). A chunk of window rows reads a few whole planes of x, each a page of its own whose
 * lines the hardware prefetcher does not fetch ahead: the walks ask for the next chunk's. */
static inline void lamina_prefetch_window_rows(const char *x, long D, long H, long W, long size,
                                               const long *geo, long oH, long r0, long r1, int write) {
    if (r1 <= r0) return;
    long kd = geo[0], kh = geo[1], sd = geo[3], sh = geo[4], pd = geo[6], ph = geo[7], dd = geo[9], dh = geo[10];
    long od0 = r0 / oH, oh0 = r0 % oH, od1 = (r1 - 1) / oH, oh1 = (r1 - 1) % oH;
    long d0 = od0 * sd - pd, d1 = od1 * sd - pd + (kd - 1) * dd;
    long h0 = od0 == od1 ? oh0 * sh - ph : 0, h1 = od0 == od1 ? oh1 * sh - ph + (kh - 1) * dh : H - 1;
    d0 = d0 < 0 ? 0 : d0;
    d1 = d1 >= D ? D - 1 : d1;
    h0 = h0 < 0 ? 0 : h0;
    h1 = h1 >= H ? H - 1 : h1;
    if (h1 < h0) return;
    for (long d = d0; d <= d1; d++) {
        const char *from = x + (d * H + h0) * W * size, *to = x + (d * H + h1 + 1) * W * size;
        for (const char *p = from; p < to; p += 64) {
            if (write)
                __builtin_prefetch(p, 1, 3);
            else
                __builtin_prefetch(p, 0, 3);
        }
    }
}

#define LAMINA_IMPL "volumes_impl.h"
#include "instantiate.h"

#endif
