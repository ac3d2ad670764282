/* vol2col and col2vol for one channel of a volume (float and double), called per channel from
 * lamina._kernels (which spreads the channels over the threads).
 *
 * A row of the column matrix over one window row is a strided run of an input row: contiguous
 * for stride 1, every other value for stride 2 (a transposed convolution's usual stride, whose
 * backward gathers the output gradient this way and whose forward scatters into its output).
 * Both are compiled for AVX2 + FMA (clones.h), and stride 2 moves two vectors at a time through a
 * shuffle instead of one value at a time (measured: these loops were 40% of a transposed
 * convolution's training step). A scatter with width stride 2 adds all the kw taps of a window
 * row in one read-add-write of the row (bench A forward, 1 thread: col2vol 7.2-7.7 ms before,
 * 4.8-5.6 ms after, against 10.3-10.7 ms in its GEMMs). */
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

#define LAMINA_IMPL "volumes_impl.h"
#include "instantiate.h"

#endif
