/* lamina's own int8 product for CPUs where MKL's u8 x s8 GEMM runs no kernel of its own (every
 * non-Intel CPU: there MKL's packed s8 product ran at 41-43 GOP/s against 111-122 GFLOP/s for its
 * packed sgemm on a 2-core AMD EPYC). c[m x n] = dequantized(u8(a) · W) for a weight W quantized
 * to int8 per output channel and packed once; a's rows are quantized to u8 in the same call.
 *
 * The weight's int8 values go into panels of 16 output channels, in quads of 4 depths (k padded
 * to whole quads with zeros):
 *
 *     panel p, quad kq, channel j, depth r:  byte ((p·quads + kq)·16 + j)·4 + r = W[16p + j, 4kq + r]
 *
 * (where AMX runs, k is padded to whole tiles of 16 quads: amx_tiles.h, whose tdpbusd sums the
 * same integers as vpdpbusd, a tile of 16 rows of a at a time)
 * so one 32-byte vector holds 4 depths of 8 channels. Per quad and row of a, the AVX2 kernel
 * broadcasts a's 4 bytes, multiplies them with vpmaddubsw (u8 x s8, pairs summed to int16),
 * adds the pairs with vpmaddwd by ones (int32) and those to the row's sums: 4 rows x 16 channels
 * in 8 registers. vpmaddubsw saturates its int16 pair sums: a's rows are quantized to 127 steps
 * (7 bits: 2 · 127 · 127 = 32258 fits), so every sum is exact; the portable kernel computes the
 * same integers, and so does the AVX-512 VNNI kernel (vpdpbusd: a quad's four products summed
 * into int32 in one instruction) where the CPU has it. The int32 sums go back to float32 in the
 * tile's store:
 *
 *     c[i, j] = row_scale[i] · col_scale[j] · (sum[i, j] - zero[i] · col_sum[j]) + (bias[j], or beta · c[i, j])
 *
 * (lamina_dequantize_row's numbers), never held in a buffer of int32 sums. */
#ifndef LAMINA_INT8_PANELS_H
#define LAMINA_INT8_PANELS_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include "dot_panels.h"
#include "quantize.h"
#include "team.h"

#define INT8_NR DOT_NR
#define INT8_MR 4
/* the activation rows' steps: no int16 pair sum of vpmaddubsw saturates (see above) */
#define INT8_ACTIVATION_LEVELS 127

/* The AVX2 kernel is compiled where the module may run it: the module with AVX2 clones and the
 * AVX-512 one (every AVX-512 CPU has AVX2), not the baseline one. */
#if defined(__x86_64__) && defined(__GNUC__) && !(defined(LAMINA_NO_CLONES) && !defined(LAMINA_TARGET_V4))
#define LAMINA_INT8_AVX2 1
#endif
/* The VNNI kernel is compiled in the AVX-512 module alone, so LAMINA_ISA=avx2 runs (and tests) the
 * AVX2 one on a CPU that has both. */
#if defined(LAMINA_INT8_AVX2) && defined(LAMINA_TARGET_V4)
#define LAMINA_INT8_VNNI 1
#endif

/* quads of depths in a row of u8 values and in a panel (whole tiles where AMX runs) */
static inline long lamina_int8_quads(long k) { return lamina_dot_groups((k + 3) / 4); }
static inline long lamina_int8_panels(long n) { return (n + INT8_NR - 1) / INT8_NR; }
/* bytes of the panels of a k-deep, n-channel weight */
static inline long lamina_int8_pack_size(long k, long n) {
    return lamina_int8_panels(n) * lamina_int8_quads(k) * INT8_NR * 4;
}

/* Panels [p0, p1) of q (n x k int8, a row per output channel) into out (layout above). */
static void lamina_int8_pack(const int8_t *restrict q, long k, long n, long p0, long p1, int8_t *restrict out) {
    const long quads = lamina_int8_quads(k);
    for (long p = p0; p < p1; p++)
        for (long kq = 0; kq < quads; kq++) {
            int8_t *dst = out + (p * quads + kq) * INT8_NR * 4;
            for (long j = 0; j < INT8_NR; j++)
                for (long r = 0; r < 4; r++) {
                    long col = p * INT8_NR + j, kk = 4 * kq + r;
                    dst[j * 4 + r] = col < n && kk < k ? q[col * k + kk] : 0;
                }
        }
}

/* How the int32 sums go back to float32 (formula above): per row of a its scale and zero point,
 * per channel its scale and the sum of its integers; bias (n values) or NULL, then beta. */
typedef struct {
    float *row_scale;
    int32_t *zero;
    const float *col_scale, *bias;
    const int32_t *col_sum;
    float beta, *c;
    long ldc;
} lamina_int8_out;

/* Row i of a tile's sums (nr <= 16 of them, from channel col) back to c. */
static inline void lamina_int8_store_row(const lamina_int8_out *o, long i, long col, long nr, const int32_t *sums) {
    lamina_dequantize_row(sums, nr, o->row_scale[i], o->zero[i], o->col_scale + col, o->col_sum + col,
                          o->bias ? o->bias + col : NULL, o->beta, o->c + i * o->ldc + col);
}

/* One row of a (k values) as u8 in `levels` steps into u, zero-padded to ldu bytes (whole quads),
 * with its scale and zero point */
static inline void lamina_int8_quantize_row(const float *a, long k, int levels, uint8_t *u, long ldu, float *scale,
                                            int32_t *zero) {
    lamina_quantize_row_u8(a, k, levels, u, scale, zero);
    memset(u + k, 0, ldu - k);
}

/* Rows [0, mr) of u (u8 rows of stride ldu, whole quads) times one panel, any CPU (a lamina_dot_panel_fn). */
static void lamina_int8_panel_portable(long mr, long quads, const uint8_t *u, long ldu, const void *panel,
                                       const void *out, long i0, long col, long nr) {
    const lamina_int8_out *o = out;
    for (long i = 0; i < mr; i++) {
        int32_t sums[INT8_NR] = {0};
        const uint8_t *a = u + i * ldu;
        for (long kq = 0; kq < quads; kq++) {
            const int8_t *b = (const int8_t *)panel + kq * INT8_NR * 4;
            for (long j = 0; j < INT8_NR; j++)
                for (long r = 0; r < 4; r++)
                    sums[j] += (int32_t)a[4 * kq + r] * (int32_t)b[j * 4 + r];
        }
        lamina_int8_store_row(o, i0 + i, col, nr, sums);
    }
}

#ifdef LAMINA_INT8_AVX2
/* Row r of a tile's int32 sums (two vectors of 8 channels) back to float32 in c (formula above). */
static inline __attribute__((always_inline, target("avx2"))) void
lamina_int8_store_tile_row(const lamina_int8_out *o, long r, long col, long nr, const __m256i acc[2]) {
    float *c = o->c + r * o->ldc + col;
    if (nr < INT8_NR) {
        int32_t sums[INT8_NR];
        _mm256_storeu_si256((__m256i *)sums, acc[0]);
        _mm256_storeu_si256((__m256i *)(sums + 8), acc[1]);
        lamina_int8_store_row(o, r, col, nr, sums);
        return;
    }
    const __m256i zero = _mm256_set1_epi32(o->zero[r]);
    const __m256 rs = _mm256_set1_ps(o->row_scale[r]);
    for (int h = 0; h < 2; h++) {
        const long j = col + 8 * h;
        const __m256i sums = _mm256_loadu_si256((const __m256i *)(o->col_sum + j));
        const __m256 diff = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[h], _mm256_mullo_epi32(zero, sums)));
        __m256 v = _mm256_mul_ps(_mm256_mul_ps(rs, _mm256_loadu_ps(o->col_scale + j)), diff);
        if (o->bias)
            v = _mm256_add_ps(v, _mm256_loadu_ps(o->bias + j));
        else if (o->beta != 0.0f)
            v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(o->beta), _mm256_loadu_ps(c + 8 * h)));
        _mm256_storeu_ps(c + 8 * h, v);
    }
}

#define DOT_ACC __m256i
#define DOT_ZERO() _mm256_setzero_si256()
#define DOT_OUT lamina_int8_out
#define DOT_STORE lamina_int8_store_tile_row

/* AVX2: vpmaddubsw (u8 x s8, pairs summed to int16, exact for 127 steps) and vpmaddwd by ones */
#define DOT_KERNEL(name) lamina_int8_##name##_avx2
#define DOT_TARGET "avx2"
#define DOT_ROWS 4
#define DOT(acc, x, b) _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x, b), _mm256_set1_epi16(1)))
#include "dot_panel_impl.h"
#undef DOT_KERNEL
#undef DOT_TARGET
#undef DOT_ROWS
#undef DOT

#ifdef LAMINA_INT8_VNNI
/* AVX-512 VNNI on 256-bit vectors: vpdpbusd sums each quad's four products into int32 in one
 * instruction, the same integers as the AVX2 pair (no int16 step to saturate; the activations
 * keep 127 steps, so every path of a network rounds them alike) */
#define DOT_KERNEL(name) lamina_int8_##name##_vnni
#define DOT_TARGET "avx2,avx512vl,avx512vnni"
/* six rows: twelve chains of vpdpbusd, enough to cover its latency at two a cycle */
#define DOT_ROWS 6
/* acc += x (u8) · b (s8) in place. (GCC 12's _mm256_dpbusd_epi32 left the tile's loop copying its
 * accumulators between registers, a vmovdqa for every vpdpbusd: Linear 256 -> 4096 over 1878 rows
 * 11.8 ms; with the accumulator tied in place here, 6.3 ms on an AMD Zen 4, 2 threads.) */
static inline __attribute__((always_inline, target("avx2,avx512vl,avx512vnni"))) __m256i
lamina_int8_dot_vnni(__m256i acc, __m256i x, __m256i b) {
    __asm__("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(x), "v"(b));
    return acc;
}
#define DOT(acc, x, b) lamina_int8_dot_vnni(acc, x, b)
#include "dot_panel_impl.h"
#ifdef LAMINA_AMX
/* AMX: tdpbusd adds a row tile's quads times a panel tile's to 16 x 16 int32 sums */
#define AMX_KERNEL(name) lamina_int8_##name##_amx
#define AMX_TARGET DOT_TARGET
#define AMX_DOT(c, a, b) _tile_dpbusd(c, a, b)
#define AMX_SUM int32_t
#include "amx_panel_impl.h"
#undef AMX_KERNEL
#undef AMX_TARGET
#undef AMX_DOT
#undef AMX_SUM
#endif
#undef DOT_KERNEL
#undef DOT_TARGET
#undef DOT_ROWS
#undef DOT
#endif

#undef DOT_ACC
#undef DOT_ZERO
#undef DOT_OUT
#undef DOT_STORE
#endif

/* whether this module's int8 product runs the AVX2 kernel on this CPU (or the VNNI one) */
static inline int lamina_int8_uses_avx2(void) {
#ifdef LAMINA_INT8_AVX2
    return __builtin_cpu_supports("avx2");
#else
    return 0;
#endif
}

/* whether it runs the AVX-512 VNNI kernel */
static inline int lamina_int8_uses_vnni(void) {
#ifdef LAMINA_INT8_VNNI
    return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* Rows [i0, i1) of a (u: their u8 values, whole quads of stride ldu) times panels [p0, p1), by
 * the widest kernel of the module and the CPU. */
static void lamina_int8_gemm(long i0, long i1, long k, long n, const uint8_t *u, long ldu, const int8_t *packed,
                             long p0, long p1, const lamina_int8_out *o) {
#ifdef LAMINA_AMX
    if (lamina_amx_on) {
        lamina_int8_gemm_amx(i0, i1, lamina_int8_quads(k), n, u, ldu, packed, p0, p1, o);
        return;
    }
#endif
    lamina_dot_panel_fn panel = lamina_int8_panel_portable;
#ifdef LAMINA_INT8_AVX2
    if (lamina_int8_uses_avx2())
        panel = lamina_int8_panel_avx2;
#endif
#ifdef LAMINA_INT8_VNNI
    if (lamina_int8_uses_vnni())
        panel = lamina_int8_panel_vnni;
#endif
    lamina_dot_gemm(panel, i0, i1, lamina_int8_quads(k), n, u, ldu, packed, p0, p1, o);
}

/* The whole product on a team of `threads` (team.h): first each member quantizes its block of
 * a's rows (u8, INT8_ACTIVATION_LEVELS steps, zero-padded to whole quads in u: m x ldu bytes;
 * row_scale and zero: m values each, filled here), then each takes its share of the panels, or
 * with by_rows its block of whole row tiles. */
typedef struct {
    long m, k, n, lda, ldu;
    const float *a;
    uint8_t *u;
    const int8_t *packed;
    lamina_int8_out out;
} lamina_int8_job;

static void lamina_int8_job_rows(void *job, long i0, long i1) {
    lamina_int8_job *j = job;
    for (long i = i0; i < i1; i++)
        lamina_int8_quantize_row(j->a + i * j->lda, j->k, INT8_ACTIVATION_LEVELS, j->u + i * j->ldu, j->ldu,
                                 &j->out.row_scale[i], &j->out.zero[i]);
}

static void lamina_int8_job_part(void *job, long r0, long r1, long q0, long q1) {
    const lamina_int8_job *j = job;
    lamina_int8_gemm(r0, r1, j->k, j->n, j->u, j->ldu, j->packed, q0, q1, &j->out);
}

static void lamina_int8_product_team(long m, long k, long n, const float *a, long lda, uint8_t *u, long ldu,
                                     const int8_t *packed, lamina_int8_out out, int threads, int by_rows) {
    lamina_int8_job job = {m, k, n, lda, ldu, a, u, packed, out};
    lamina_panels_product product = {&job, m, lamina_dot_tile_rows(INT8_MR), lamina_int8_panels(n), by_rows,
                                     lamina_int8_job_rows, lamina_int8_job_part};
    lamina_panels_product_team(product, threads);
}

#endif
