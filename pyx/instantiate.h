/* Compiles the implementation file named by LAMINA_IMPL twice, once per element type:
 *     REAL   float                 double
 *     VEC    8 floats (32 bytes)   4 doubles (32 bytes)
 *     IVEC   8 ints                4 longs  (shuffle masks for VEC)
 *     LANES  8                     4
 *     TANH   lamina_fast_tanhf     tanh     (where the includer declared lamina_fast_tanhf)
 *     EXP    lamina_fast_expf      exp      (where the includer declared lamina_fast_expf)
 *     SUFFIXED(name) -> name_f     name_d
 * Usage: #define LAMINA_IMPL "x_impl.h", then #include "instantiate.h" (no include guard: each
 * header that instantiates includes it once). */
#include <math.h>

typedef float lamina_v8f __attribute__((vector_size(32)));
typedef double lamina_v4d __attribute__((vector_size(32)));
typedef int lamina_v8i __attribute__((vector_size(32)));
typedef long lamina_v4l __attribute__((vector_size(32)));

#define SUFFIXED_(name, sfx) name##_##sfx
#define SUFFIXED2(name, sfx) SUFFIXED_(name, sfx)

#define REAL float
#define VEC lamina_v8f
#define IVEC lamina_v8i
#define LANES 8
#define TANH lamina_fast_tanhf
#define EXP lamina_fast_expf
#define SUFFIXED(name) SUFFIXED2(name, f)
#include LAMINA_IMPL
#undef REAL
#undef VEC
#undef IVEC
#undef LANES
#undef TANH
#undef EXP
#undef SUFFIXED

#define REAL double
#define VEC lamina_v4d
#define IVEC lamina_v4l
#define LANES 4
#define TANH tanh
#define EXP exp
#define SUFFIXED(name) SUFFIXED2(name, d)
#include LAMINA_IMPL
#undef REAL
#undef VEC
#undef IVEC
#undef LANES
#undef TANH
#undef EXP
#undef SUFFIXED

#undef LAMINA_IMPL
