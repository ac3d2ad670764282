/* vol2col and col2vol for one channel of a volume (float and double), called per channel from
 * lamina._kernels (which spreads the channels over the threads).
 *
 * A row of the column matrix over one window row is a strided run of an input row: contiguous
 * for stride 1, every other value for stride 2 (a transposed convolution's usual stride, whose
 * backward gathers the output gradient this way and whose forward scatters into its output).
 * Both are compiled for AVX2 + FMA (clones.h), and stride 2 moves two vectors at a time through a
 * shuffle instead of one value at a time (measured: these loops were 40% of a transposed
 * convolution's training step). */
#ifndef LAMINA_VOLUMES_H
#define LAMINA_VOLUMES_H

#include <string.h>
#include "clones.h"

typedef float lamina_vv8f __attribute__((vector_size(32)));
typedef double lamina_vv4d __attribute__((vector_size(32)));
typedef int lamina_vv8i __attribute__((vector_size(32)));
typedef long lamina_vv4l __attribute__((vector_size(32)));

/* window columns ow in [lo, hi) whose input column ow·s + off lies in [0, W) */
static inline void lamina_valid_range(long oW, long W, long s, long off, long *lo, long *hi) {
    *lo = off >= 0 ? 0 : (-off + s - 1) / s;
    *hi = W - 1 - off < 0 ? 0 : (W - 1 - off) / s + 1;
    if (*hi > oW) *hi = oW;
    if (*lo > *hi) *lo = *hi;
}

#define SUFFIXED_(name, sfx) name##_##sfx
#define SUFFIXED2(name, sfx) SUFFIXED_(name, sfx)

#define REAL float
#define VEC lamina_vv8f
#define IVEC lamina_vv8i
#define LANES 8
#define EVENS {0, 2, 4, 6, 8, 10, 12, 14}
#define ZIP_LO {0, 8, 1, 9, 2, 10, 3, 11}
#define ZIP_HI {4, 12, 5, 13, 6, 14, 7, 15}
#define SUFFIXED(name) SUFFIXED2(name, f)
#include "volumes_impl.h"
#undef REAL
#undef VEC
#undef IVEC
#undef LANES
#undef EVENS
#undef ZIP_LO
#undef ZIP_HI
#undef SUFFIXED

#define REAL double
#define VEC lamina_vv4d
#define IVEC lamina_vv4l
#define LANES 4
#define EVENS {0, 2, 4, 6}
#define ZIP_LO {0, 4, 1, 5}
#define ZIP_HI {2, 6, 3, 7}
#define SUFFIXED(name) SUFFIXED2(name, d)
#include "volumes_impl.h"
#undef REAL
#undef VEC
#undef IVEC
#undef LANES
#undef EVENS
#undef ZIP_LO
#undef ZIP_HI
#undef SUFFIXED

#endif
