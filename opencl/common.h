/* What every kernel file of lamina starts with: the element type (-D REAL=float|double, with
 * -D USE_DOUBLE for double), array arguments as (buffer, offset in elements), and outputs
 * written "with beta" (out = new + beta * out; beta == 0 never reads out). */
#ifndef LAMINA_COMMON_H
#define LAMINA_COMMON_H

#ifndef REAL
#define REAL float
#endif
#ifdef USE_DOUBLE
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#endif

#define ARG(T, x) __global T* x##_base, const int x##_off
#define AT(T, x) __global T* x = x##_base + x##_off
#define WITH_BETA(out, value, beta) ((beta) == 0 ? (value) : (value) + (beta) * (out))

#endif
