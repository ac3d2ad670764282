/* Row primitives for the selective kernels: dot products, combinations of rows and prefetches
 * over contiguous rows.
 *
 * The dots and combinations are compiled for AVX2 + FMA and for the baseline (clones.h). The dots keep four independent
 * vector accumulators: a single one would wait on each add's latency. */
#ifndef LAMINA_ROWS_H
#define LAMINA_ROWS_H

#include <string.h>

#include "clones.h"

typedef float lamina_v8f __attribute__((vector_size(32)));
typedef double lamina_v4d __attribute__((vector_size(32)));

#define LAMINA_DOT_BODY(T, V, LANES)                                              \
    V acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}, va, vb;                     \
    long j = 0;                                                                   \
    for (; j + 4 * LANES <= n; j += 4 * LANES) {                                  \
        memcpy(&va, a + j, sizeof va); memcpy(&vb, b + j, sizeof vb);             \
        acc0 += va * vb;                                                          \
        memcpy(&va, a + j + LANES, sizeof va); memcpy(&vb, b + j + LANES, sizeof vb); \
        acc1 += va * vb;                                                          \
        memcpy(&va, a + j + 2 * LANES, sizeof va); memcpy(&vb, b + j + 2 * LANES, sizeof vb); \
        acc2 += va * vb;                                                          \
        memcpy(&va, a + j + 3 * LANES, sizeof va); memcpy(&vb, b + j + 3 * LANES, sizeof vb); \
        acc3 += va * vb;                                                          \
    }                                                                             \
    V acc = (acc0 + acc1) + (acc2 + acc3);                                        \
    T s = 0;                                                                      \
    for (int l = 0; l < LANES; l++) s += acc[l];                                  \
    for (; j < n; j++) s += a[j] * b[j];                                          \
    return s;

LAMINA_CLONES static float lamina_dot_f(const float* a, const float* b, long n) {
    LAMINA_DOT_BODY(float, lamina_v8f, 8)
}

LAMINA_CLONES static double lamina_dot_d(const double* a, const double* b, long n) {
    LAMINA_DOT_BODY(double, lamina_v4d, 4)
}

/* Sums over a row in double, in four independent vector accumulators (one running sum waits
 * on each add's latency: about 1 ns per value): Σ a[j], and Σ (a[j] - m)² for a variance. */
typedef float lamina_v4f __attribute__((vector_size(16)));

#define LAMINA_SUM_BODY(LOAD, TERM)                                                \
    lamina_v4d acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}, v;                 \
    long j = 0;                                                                   \
    for (; j + 16 <= n; j += 16) {                                                \
        v = LOAD(a + j);      acc0 += TERM;                                       \
        v = LOAD(a + j + 4);  acc1 += TERM;                                       \
        v = LOAD(a + j + 8);  acc2 += TERM;                                       \
        v = LOAD(a + j + 12); acc3 += TERM;                                       \
    }                                                                             \
    lamina_v4d acc = (acc0 + acc1) + (acc2 + acc3);                               \
    double s = (acc[0] + acc[1]) + (acc[2] + acc[3]);                             \
    for (; j < n; j++) {                                                          \
        v = (lamina_v4d){a[j], 0, 0, 0};                                          \
        v = TERM;                                                                 \
        s += v[0];                                                                \
    }                                                                             \
    return s;

static inline __attribute__((always_inline)) lamina_v4d lamina_load4_f(const float* p) {
    lamina_v4f v;
    memcpy(&v, p, sizeof v);
    return __builtin_convertvector(v, lamina_v4d);
}

static inline __attribute__((always_inline)) lamina_v4d lamina_load4_d(const double* p) {
    lamina_v4d v;
    memcpy(&v, p, sizeof v);
    return v;
}

LAMINA_CLONES static double lamina_sum_f(const float* a, long n) {
    LAMINA_SUM_BODY(lamina_load4_f, v)
}

LAMINA_CLONES static double lamina_sum_d(const double* a, long n) {
    LAMINA_SUM_BODY(lamina_load4_d, v)
}

LAMINA_CLONES static double lamina_sum_sq_dev_f(const float* a, long n, double m) {
    LAMINA_SUM_BODY(lamina_load4_f, (v - m) * (v - m))
}

LAMINA_CLONES static double lamina_sum_sq_dev_d(const double* a, long n, double m) {
    LAMINA_SUM_BODY(lamina_load4_d, (v - m) * (v - m))
}

/* ask for a row that a loop will read soon (one hint per 64-byte line) */
static inline void lamina_prefetch(const void* p, long bytes) {
    for (long off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 0);
}

/* the same for a row read several times soon: kept in every cache level */
static inline void lamina_prefetch_kept(const void* p, long bytes) {
    for (long off = 0; off < bytes; off += 64) __builtin_prefetch((const char*)p + off, 0, 3);
}

/* y = Σ_k coef[k] · rows[index[k]] (+ beta y; beta 0 never reads y): m rows of n values, ld
 * apart, weighted and summed in registers 8 vectors (256 bytes of columns) at a time before
 * one store per block, where an axpby per row would read and write y m times. The rows lie
 * anywhere (a selection's rows of a weight or of the inputs): while the first block of columns
 * is summed, each row LAMINA_COMBINE_AHEAD places ahead is fetched whole, so the random reads
 * overlap instead of each waiting on memory, and the later blocks find the rows in cache. The
 * indices were checked by the caller. */
#define LAMINA_COMBINE_AHEAD 4
#define LAMINA_COMBINE_BODY(T, V, LANES)                                           \
    const long B = 8 * LANES;                                                     \
    long j0 = 0;                                                                  \
    for (; j0 + B <= n; j0 += B) {                                                \
        V a[8] = {{0}}, v;                                                        \
        for (long k = 0; k < m; k++) {                                            \
            if (j0 == 0 && k + LAMINA_COMBINE_AHEAD < m)                          \
                lamina_prefetch_kept(rows + (long)index[k + LAMINA_COMBINE_AHEAD] * ld, n * (long)sizeof(T)); \
            const T *r = rows + (long)index[k] * ld + j0, c = coef[k];            \
            for (int q = 0; q < 8; q++) {                                         \
                memcpy(&v, r + q * LANES, sizeof v);                              \
                a[q] += c * v;                                                    \
            }                                                                     \
        }                                                                         \
        for (int q = 0; q < 8; q++) {                                             \
            if (beta != 0) {                                                      \
                memcpy(&v, y + j0 + q * LANES, sizeof v);                         \
                a[q] += beta * v;                                                 \
            }                                                                     \
            memcpy(y + j0 + q * LANES, &a[q], sizeof v);                          \
        }                                                                         \
    }                                                                             \
    for (long j = j0; j < n; j++) {                                               \
        T acc = 0;                                                                \
        for (long k = 0; k < m; k++) acc += coef[k] * rows[(long)index[k] * ld + j]; \
        y[j] = beta != 0 ? acc + beta * y[j] : acc;                               \
    }

LAMINA_CLONES static void lamina_combine_rows_f(const float* rows, long ld, const int* index, const float* coef,
                                                long m, float beta, float* y, long n) {
    LAMINA_COMBINE_BODY(float, lamina_v8f, 8)
}

LAMINA_CLONES static void lamina_combine_rows_d(const double* rows, long ld, const int* index, const double* coef,
                                                long m, double beta, double* y, long n) {
    LAMINA_COMBINE_BODY(double, lamina_v4d, 4)
}

/* ---- rows of bfloat16 values (16-bit patterns: a float32's upper half, convert.h), summed in
 * float32: the selective layer's products in bfloat16, which read half the bytes of float32 rows */
static inline float lamina_from_bf16(unsigned short b) {
    unsigned int u = (unsigned int)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Vectors of the bfloat16 rows' float32 sums: 16 lanes in the AVX-512 build, else 8 (wider generic
 * vectors in an AVX2 clone ran at less than half the speed) */
#if defined(LAMINA_TARGET_V4)
#define LAMINA_BF16_LANES 16
#else
#define LAMINA_BF16_LANES 8
#endif
typedef float lamina_vbf __attribute__((vector_size(4 * LAMINA_BF16_LANES)));
typedef unsigned int lamina_vbf_bits __attribute__((vector_size(4 * LAMINA_BF16_LANES)));

/* 2·LAMINA_BF16_LANES bfloat16 values from p as the float32 values of its even and of its odd
 * columns: each 32-bit word holds a pair, the even column's value shifted left, the odd one's
 * masked */
static inline __attribute__((always_inline)) void lamina_load_bf16_pairs(const unsigned short* p, lamina_vbf* even,
                                                                         lamina_vbf* odd) {
    lamina_vbf_bits w;
    memcpy(&w, p, sizeof w);
    const lamina_vbf_bits shifted = w << 16, masked = w & 0xffff0000u;
    memcpy(even, &shifted, sizeof *even);
    memcpy(odd, &masked, sizeof *odd);
}

/* y = Σ_k coef[k] · rows[index[k]] (+ beta y) over rows of bfloat16 values (as lamina_combine_rows_f,
 * blocks of 8·LAMINA_BF16_LANES columns): each 2·LAMINA_BF16_LANES columns take one load, a
 * shift, a mask (lamina_load_bf16_pairs) and two multiply-adds into the even and odd columns'
 * sums, interleaved once per block when stored. */
LAMINA_CLONES static void lamina_combine_rows_bf16(const unsigned short* rows, long ld, const int* index,
                                                   const float* coef, long m, float beta, float* y, long n) {
    const long L = LAMINA_BF16_LANES, B = 8 * L;
    long j0 = 0;
    for (; j0 + B <= n; j0 += B) {
        lamina_vbf even[4] = {{0}}, odd[4] = {{0}};
        for (long k = 0; k < m; k++) {
            if (j0 == 0 && k + LAMINA_COMBINE_AHEAD < m)
                lamina_prefetch_kept(rows + (long)index[k + LAMINA_COMBINE_AHEAD] * ld, n * (long)sizeof(*rows));
            const unsigned short *r = rows + (long)index[k] * ld + j0;
            const float c = coef[k];
            for (int q = 0; q < 4; q++) {
                lamina_vbf lo, hi;
                lamina_load_bf16_pairs(r + 2 * L * q, &lo, &hi);
                even[q] += c * lo;
                odd[q] += c * hi;
            }
        }
        for (int q = 0; q < 4; q++)
            for (int l = 0; l < L; l++) {
                float *out = y + j0 + 2 * L * q + 2 * l;
                out[0] = beta != 0 ? even[q][l] + beta * out[0] : even[q][l];
                out[1] = beta != 0 ? odd[q][l] + beta * out[1] : odd[q][l];
            }
    }
    for (long j = j0; j < n; j++) {
        float acc = 0;
        for (long k = 0; k < m; k++) acc += coef[k] * lamina_from_bf16(rows[(long)index[k] * ld + j]);
        y[j] = beta != 0 ? acc + beta * y[j] : acc;
    }
}

#if defined(__x86_64__) && defined(__GNUC__) && defined(LAMINA_TARGET_V4)
#include <immintrin.h>
#define LAMINA_DOT_BF16_KERNEL 1
/* Σ a[j] b[j] over n bfloat16 values, 32 a vdpbf16ps (products exact, summed in float32 in two
 * chains), the last fewer under a mask. Only where the CPU has AVX512-BF16. */
__attribute__((target("avx512f,avx512bw,avx512bf16"))) static float lamina_dot_bf16_avx512(
        const unsigned short* a, const unsigned short* b, long n) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    long j = 0;
    for (; j + 64 <= n; j += 64) {
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_loadu_si512(a + j), (__m512bh)_mm512_loadu_si512(b + j));
        acc1 = _mm512_dpbf16_ps(acc1, (__m512bh)_mm512_loadu_si512(a + j + 32),
                                (__m512bh)_mm512_loadu_si512(b + j + 32));
    }
    for (; j < n; j += 32) {
        const __mmask32 keep = n - j >= 32 ? ~(__mmask32)0 : (((__mmask32)1 << (n - j)) - 1);
        acc0 = _mm512_dpbf16_ps(acc0, (__m512bh)_mm512_maskz_loadu_epi16(keep, a + j),
                                (__m512bh)_mm512_maskz_loadu_epi16(keep, b + j));
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
}
#endif

LAMINA_CLONES static float lamina_dot_bf16_portable(const unsigned short* a, const unsigned short* b, long n) {
    const long L = LAMINA_BF16_LANES;
    lamina_vbf acc0 = {0}, acc1 = {0}, acc2 = {0}, acc3 = {0}, a_even, a_odd, b_even, b_odd;
    long j = 0;
    for (; j + 4 * L <= n; j += 4 * L) {
        lamina_load_bf16_pairs(a + j, &a_even, &a_odd);
        lamina_load_bf16_pairs(b + j, &b_even, &b_odd);
        acc0 += a_even * b_even;
        acc1 += a_odd * b_odd;
        lamina_load_bf16_pairs(a + j + 2 * L, &a_even, &a_odd);
        lamina_load_bf16_pairs(b + j + 2 * L, &b_even, &b_odd);
        acc2 += a_even * b_even;
        acc3 += a_odd * b_odd;
    }
    lamina_vbf acc = (acc0 + acc1) + (acc2 + acc3);
    float s = 0;
    for (int l = 0; l < L; l++) s += acc[l];
    for (; j < n; j++) s += lamina_from_bf16(a[j]) * lamina_from_bf16(b[j]);
    return s;
}

/* whether lamina_dot_bf16 runs vdpbf16ps here (the AVX-512 build on a CPU with AVX512-BF16) */
static inline int lamina_dot_bf16_native(void) {
#ifdef LAMINA_DOT_BF16_KERNEL
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

/* Σ a[j] b[j] over n bfloat16 values in float32 (native: lamina_dot_bf16_native()) */
static inline float lamina_dot_bf16(const unsigned short* a, const unsigned short* b, long n, int native) {
#ifdef LAMINA_DOT_BF16_KERNEL
    if (native)
        return lamina_dot_bf16_avx512(a, b, n);
#endif
    (void)native;
    return lamina_dot_bf16_portable(a, b, n);
}

#endif
