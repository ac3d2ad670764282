/* Max pooling of one plane where every window lies inside it (no padding, no ceil-mode windows
 * past the end): the common case of a network's pools, run tap by tap over whole output rows so
 * the compiler vectorises the inner loop (strided loads, compares and blends) where the generic
 * loop in _kernels.pyx walks one window at a time through a chain of dependent compares.
 * Compiled for AVX2 + FMA and the baseline (clones.h). */
#ifndef LAMINA_POOLS_H
#define LAMINA_POOLS_H

#include <string.h>
#include "clones.h"
#include "epilogue.h"

#define LAMINA_IMPL "pools_impl.h"
#include "instantiate.h"

#endif
