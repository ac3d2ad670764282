/* Layer normalization (and RMSNorm) of rows, in float and double. */
#ifndef LAMINA_NORMS_H
#define LAMINA_NORMS_H
#include <math.h>
#include "clones.h"

/* columns per task in the parameter gradients (two double accumulators of this many per task) */
#define NORM_CHUNK 256

#define LAMINA_IMPL "norms_impl.h"
#include "instantiate.h"

#endif
