/* lamina's own bfloat16 product for CPUs with AVX512-BF16 where MKL runs no bfloat16 kernel of its
 * own (every non-Intel CPU: on an AMD EPYC of the Zen 4 family MKL's bfloat16 LSTM ran at 0.7x
 * lamina's float32 one). c[m x n] = alpha · bf16(a) · bf16(op(B)) (+ bias, or + beta · c): both
 * operands rounded to bfloat16 (round to nearest, ties to even: convert.h), their products summed
 * in float32. op(B) (k x n) is rounded and packed once into panels of 16 output channels, in pairs
 * of depths (k padded to whole pairs with zeros):
 *
 *     panel p, pair kp, channel j, depth r:  element ((p·pairs + kp)·16 + j)·2 + r = op(B)[2kp + r, 16p + j]
 *
 * (where AMX runs, k is padded to whole tiles of 16 pairs: amx_tiles.h, which multiplies tiles of
 * up to 16 rows of a on the same panels)
 * the layout of int8_panels.h with pairs of 16-bit values where it has quads of bytes, so the
 * same tile (dot_panel_impl.h) runs both. Per pair and row of a, the kernel broadcasts a's two
 * bfloat16 values and adds both products to each channel's float32 sum with one vdpbf16ps; a's
 * rows are rounded to bfloat16 in the same call. The kernel is compiled in the AVX-512 module alone
 * and taken where the CPU has AVX512-BF16; elsewhere the caller multiplies the rounded operands in
 * float32 (the same products, summed in another order). */
#ifndef LAMINA_BF16_PANELS_H
#define LAMINA_BF16_PANELS_H

#include <stdint.h>
#include <string.h>
#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif
#include "convert.h"
#include "dot_panels.h"
#include "team.h"

#define BF16_NR DOT_NR
#define BF16_MR 6

#if defined(__x86_64__) && defined(__GNUC__) && defined(LAMINA_TARGET_V4)
#define LAMINA_BF16_KERNEL 1
#endif

/* pairs of depths in a row of bfloat16 values and in a panel (whole tiles where AMX runs) */
static inline long lamina_bf16_pairs(long k) { return lamina_dot_groups((k + 1) / 2); }
static inline long lamina_bf16_panels(long n) { return (n + BF16_NR - 1) / BF16_NR; }
/* 16-bit values in the panels of a k-deep, n-channel op(B) */
static inline long lamina_bf16_pack_size(long k, long n) {
    return lamina_bf16_panels(n) * lamina_bf16_pairs(k) * BF16_NR * 2;
}

/* The bfloat16 pair (x: depth 2kp, y: depth 2kp + 1) of one channel as the 32 bits the panels hold */
static inline uint32_t lamina_bf16_pair(float x, float y) {
    uint32_t lo, hi;
    memcpy(&lo, &x, 4);
    memcpy(&hi, &y, 4);
    return (uint32_t)lamina_bf16_bits(lo) | (uint32_t)lamina_bf16_bits(hi) << 16;
}

/* 16 lanes of 32 bits (GCC's vector extension: one AVX-512 register) */
typedef uint32_t lamina_v16u __attribute__((vector_size(64)));

/* r[i][l] <-> r[l][i]: 16 vectors of 16 lanes transposed in registers, by swapping the off-diagonal
 * b x b blocks of every 2b x 2b block for b = 1, 2, 4, 8 (one two-source shuffle per vector and
 * step: 64 in all). */
static inline __attribute__((always_inline)) void lamina_transpose16(lamina_v16u *r) {
    const lamina_v16u lo1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30},
                      hi1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
    const lamina_v16u lo2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29},
                      hi2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
    const lamina_v16u lo4 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27},
                      hi4 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
    const lamina_v16u lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23},
                      hi8 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
#define LAMINA_TRANSPOSE_STEP(b)                                              \
    for (int i = 0; i < 16; i++)                                              \
        if (!(i & (b))) {                                                     \
            const lamina_v16u top = r[i], bottom = r[i + (b)];                \
            r[i] = __builtin_shuffle(top, bottom, lo##b);                     \
            r[i + (b)] = __builtin_shuffle(top, bottom, hi##b);               \
        }
    LAMINA_TRANSPOSE_STEP(1)
    LAMINA_TRANSPOSE_STEP(2)
    LAMINA_TRANSPOSE_STEP(4)
    LAMINA_TRANSPOSE_STEP(8)
#undef LAMINA_TRANSPOSE_STEP
}

/* 16 float32 values (their bits, in place) rounded to bfloat16 bits as lamina_bf16_bits does, each
 * in its lane's low 16 bits. (The 64-byte vectors pass by pointer: returned by value, they would
 * change the calling convention of the modules built without AVX-512.) */
static inline __attribute__((always_inline)) void lamina_bf16_bits16(lamina_v16u *v) {
    const lamina_v16u u = *v;
    const lamina_v16u rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const lamina_v16u nan = ((u >> 16) | 0x40u) & 0xffffu;
    const lamina_v16u is_nan = (lamina_v16u)((u & 0x7fffffffu) > 0x7f800000u);
    *v = (nan & is_nan) | (rounded & ~is_nan);
}

/* out = the pairs (x[l], y[l]) of 16 adjacent values of two depths, as lamina_bf16_pair's bits */
static inline __attribute__((always_inline)) void lamina_bf16_pairs16(const float *x, const float *y,
                                                                       lamina_v16u *out) {
    lamina_v16u ux, uy;
    memcpy(&ux, x, sizeof ux);
    memcpy(&uy, y, sizeof uy);
    lamina_bf16_bits16(&ux);
    lamina_bf16_bits16(&uy);
    *out = ux | uy << 16;
}

/* out = the pairs (v[2q], v[2q + 1]) of 32 adjacent values, q < 16, as lamina_bf16_pair's bits */
static inline __attribute__((always_inline)) void lamina_bf16_adjacent_pairs16(const float *v, lamina_v16u *out) {
    const lamina_v16u even = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30}, odd = even + 1;
    lamina_v16u b0, b1;
    memcpy(&b0, v, sizeof b0);
    memcpy(&b1, v + 16, sizeof b1);
    lamina_bf16_bits16(&b0);
    lamina_bf16_bits16(&b1);
    *out = __builtin_shuffle(b0, b1, even) | __builtin_shuffle(b0, b1, odd) << 16;
}

/* Panels [p0, p1) of op(b) (trans: b is n x k, a row per output channel; else k x n) into out:
 * a pair of depths of 16 channels at a time (a loop the compiler vectorises where op(b) is k x n;
 * where b is n x k, 16 pairs of 16 channels transposed in registers), element by element only at
 * the edges. */
LAMINA_CLONES static void lamina_bf16_pack(const float *restrict b, long k, long n, int trans, long p0, long p1,
                                           uint16_t *restrict out) {
    const long pairs = lamina_bf16_pairs(k);
    for (long p = p0; p < p1; p++) {
        long kp = 0;
        if (trans && (p + 1) * BF16_NR <= n)  /* 16 channels' rows by 16 pairs, transposed in registers */
            for (; 2 * (kp + 16) <= k; kp += 16) {
                lamina_v16u r[16];
                for (long j = 0; j < 16; j++)
                    lamina_bf16_adjacent_pairs16(b + (p * BF16_NR + j) * k + 2 * kp, &r[j]);
                lamina_transpose16(r);
                for (long q = 0; q < 16; q++)
                    memcpy(out + (p * pairs + kp + q) * BF16_NR * 2, &r[q], sizeof r[q]);
            }
        for (; kp < pairs; kp++) {
            const long col0 = p * BF16_NR, k0 = 2 * kp;
            uint32_t group[BF16_NR];
            if (col0 + BF16_NR <= n && k0 + 2 <= k) {
                if (trans)
                    for (long j = 0; j < BF16_NR; j++)
                        group[j] = lamina_bf16_pair(b[(col0 + j) * k + k0], b[(col0 + j) * k + k0 + 1]);
                else
                    for (long j = 0; j < BF16_NR; j++)
                        group[j] = lamina_bf16_pair(b[k0 * n + col0 + j], b[(k0 + 1) * n + col0 + j]);
            } else {
                for (long j = 0; j < BF16_NR; j++) {
                    float v[2] = {0.0f, 0.0f};
                    for (long r = 0; r < 2; r++)
                        if (col0 + j < n && k0 + r < k)
                            v[r] = trans ? b[(col0 + j) * k + k0 + r] : b[(k0 + r) * n + col0 + j];
                    group[j] = lamina_bf16_pair(v[0], v[1]);
                }
            }
            memcpy(out + (p * pairs + kp) * BF16_NR * 2, group, sizeof group);
        }
    }
}

/* The panels of op(b) on a team of `threads`, each member packing a run of panels. */
typedef struct {
    const float *b;
    long k, n;
    int trans;
    uint16_t *out;
} lamina_bf16_pack_job;

static void lamina_bf16_pack_run(void *args, int t, long p0, long p1) {
    const lamina_bf16_pack_job *j = args;
    (void)t;
    lamina_bf16_pack(j->b, j->k, j->n, j->trans, p0, p1, j->out);
}

static void lamina_bf16_pack_team(const float *b, long k, long n, int trans, uint16_t *out, int threads) {
    lamina_bf16_pack_job job = {b, k, n, trans, out};
    lamina_team_for(threads, lamina_bf16_panels(n), lamina_bf16_pack_run, &job);
}

/* One row of a (k values) as bfloat16 into u, zero-padded to whole pairs (lamina_bf16_pairs). */
static inline void lamina_bf16_row(const float *a, long k, uint16_t *u) {
    lamina_to_bfloat16(a, u, k);
    memset(u + k, 0, sizeof *u * (2 * lamina_bf16_pairs(k) - k));
}

/* Rows [i0, i1) of aᵀ, where a is k x m (lda values a row), as bfloat16 pairs into u (ldu values a
 * row): 16 rows at a time, each pair of depths read as two runs of 16 adjacent values of a; 16
 * pairs of them transposed in registers and stored as a run of 16 pairs in each of the 16 rows
 * (the last pairs and rows one 32-bit pair at a time). */
LAMINA_CLONES static void lamina_bf16_rows_of_columns(const float *restrict a, long lda, long k, long i0, long i1,
                                                      uint16_t *restrict u, long ldu) {
    const long pairs = lamina_bf16_pairs(k);
    for (long i = i0; i < i1; i += BF16_NR) {
        const long w = i1 - i < BF16_NR ? i1 - i : BF16_NR;
        long kp = 0;
        if (w == BF16_NR)  /* 16 rows by 16 pairs, transposed in registers */
            for (; 2 * (kp + 16) <= k; kp += 16) {
                lamina_v16u r[16];
                for (long q = 0; q < 16; q++)
                    lamina_bf16_pairs16(a + 2 * (kp + q) * lda + i, a + (2 * (kp + q) + 1) * lda + i, &r[q]);
                lamina_transpose16(r);
                for (long j = 0; j < 16; j++)
                    memcpy(u + (i + j) * ldu + 2 * kp, &r[j], sizeof r[j]);
            }
        for (; kp < pairs; kp++) {
            const float *x = a + 2 * kp * lda + i, *y = x + lda;
            uint32_t group[BF16_NR];
            if (2 * kp >= k)  /* (the padding to whole tiles) */
                memset(group, 0, sizeof group);
            else if (w == BF16_NR && 2 * kp + 1 < k)
                for (long j = 0; j < BF16_NR; j++)
                    group[j] = lamina_bf16_pair(x[j], y[j]);
            else
                for (long j = 0; j < w; j++)
                    group[j] = lamina_bf16_pair(x[j], 2 * kp + 1 < k ? y[j] : 0.0f);
            for (long j = 0; j < w; j++)
                memcpy(u + (i + j) * ldu + 2 * kp, &group[j], sizeof group[j]);
        }
    }
}

/* Where a tile's sums go: v = alpha · sums + (bias[j], or beta · c), bias NULL for none, then
 * act: 0 none, 1 a ReLU (0 where v < 0), 2 a ReLU capped at cap (ReLU6); NaN stays NaN and -0
 * stays -0, as epilogue_impl.h's. Row r's channel j goes to c[r·ldc + j], or with transposed to
 * c[j·ldc + r] (a convolution's output [channels, positions] from positions times the weight's
 * panels). Members past ldc are zero in a brace initializer: plain rows, no activation. */
typedef struct {
    float alpha, beta;
    const float *bias;
    float *c;
    long ldc;
    int transposed, act;
    float cap;
} lamina_bf16_out;

static inline float lamina_bf16_activate(const lamina_bf16_out *o, float v) {
    if (o->act && v < 0.0f)
        v = 0.0f;
    if (o->act == 2 && v > o->cap)
        v = o->cap;
    return v;
}

#ifdef LAMINA_BF16_KERNEL
/* Row r of a tile's float32 sums (two vectors of 8 channels) into c. */
static inline __attribute__((always_inline, target("avx2,fma"))) void
lamina_bf16_store_tile_row(const lamina_bf16_out *o, long r, long col, long nr, const __m256 acc[2]) {
    if (nr < BF16_NR || o->transposed) {
        const long step = o->transposed ? o->ldc : 1;
        float *c = o->transposed ? o->c + col * o->ldc + r : o->c + r * o->ldc + col;
        float sums[BF16_NR];
        _mm256_storeu_ps(sums, acc[0]);
        _mm256_storeu_ps(sums + 8, acc[1]);
        for (long j = 0; j < nr; j++)
            c[j * step] = lamina_bf16_activate(o, o->alpha * sums[j] + (o->bias ? o->bias[col + j]
                                                                        : o->beta != 0.0f ? o->beta * c[j * step]
                                                                                          : 0.0f));
        return;
    }
    float *c = o->c + r * o->ldc + col;
    const __m256 alpha = _mm256_set1_ps(o->alpha), zero = _mm256_setzero_ps(), cap = _mm256_set1_ps(o->cap);
    for (int h = 0; h < 2; h++) {
        __m256 v = _mm256_mul_ps(alpha, acc[h]);
        if (o->bias)
            v = _mm256_add_ps(v, _mm256_loadu_ps(o->bias + col + 8 * h));
        else if (o->beta != 0.0f)
            v = _mm256_fmadd_ps(_mm256_set1_ps(o->beta), _mm256_loadu_ps(c + 8 * h), v);
        if (o->act)
            v = _mm256_andnot_ps(_mm256_cmp_ps(v, zero, _CMP_LT_OQ), v);
        if (o->act == 2)
            v = _mm256_blendv_ps(v, cap, _mm256_cmp_ps(v, cap, _CMP_GT_OQ));
        _mm256_storeu_ps(c + 8 * h, v);
    }
}

#define DOT_ACC __m256
#define DOT_ZERO() _mm256_setzero_ps()
#define DOT_OUT lamina_bf16_out
#define DOT_STORE lamina_bf16_store_tile_row
#define DOT_KERNEL(name) lamina_bf16_##name##_avx512
#define DOT_TARGET "avx2,fma,avx512vl,avx512bf16"
/* six rows: twelve chains of vdpbf16ps */
#define DOT_ROWS BF16_MR
#define DOT(acc, x, b) _mm256_dpbf16_ps(acc, (__m256bh)(x), (__m256bh)(b))
#include "dot_panel_impl.h"
#ifdef LAMINA_AMX
/* A tile's sums (16 x 16, row-major: rows of positions row.., channels col..) stored transposed:
 * channel j's `rows` positions a run at c[(col + j)·ldc + row], lamina_bf16_store_tile_row's
 * numbers, the tile transposed in registers (a convolution's output [channels, positions]).
 * Against a row of 16 sums at a time element by element, alternating builds on an Intel Xeon with
 * AMX, 2 threads, batch 16 in bfloat16: MobileNet-V2's 320 -> 1280 pointwise layer at 7x7
 * 0.98-1.16 ms against 1.13-1.16, a 3x3 stride-2 layer 3.22-3.57 against 3.43-3.53. */
static inline __attribute__((always_inline)) void
lamina_bf16_store_transposed_amx(const lamina_bf16_out *o, const float *sums, long rows, long row, long col,
                                 long nr) {
    lamina_v16u t[16];
    memcpy(t, sums, sizeof t);
    lamina_transpose16(t);
    for (long j = 0; j < nr; j++) {
        float v[16], *c = o->c + (col + j) * o->ldc + row;
        memcpy(v, &t[j], sizeof v);
        const float bias = o->bias ? o->bias[col + j] : 0.0f;
        if (o->bias || o->beta == 0.0f)
            for (long i = 0; i < rows; i++)
                c[i] = lamina_bf16_activate(o, o->alpha * v[i] + bias);
        else
            for (long i = 0; i < rows; i++)
                c[i] = lamina_bf16_activate(o, o->alpha * v[i] + o->beta * c[i]);
    }
}

/* AMX: tdpbf16ps adds a row tile's pairs times a panel tile's to 16 x 16 float32 sums */
#define AMX_KERNEL(name) lamina_bf16_##name##_amx
#define AMX_TARGET DOT_TARGET
#define AMX_DOT(c, a, b) _tile_dpbf16ps(c, a, b)
#define AMX_SUM float
#define AMX_STORE_TRANSPOSED lamina_bf16_store_transposed_amx
#include "amx_panel_impl.h"
#undef AMX_KERNEL
#undef AMX_TARGET
#undef AMX_DOT
#undef AMX_SUM
#undef AMX_STORE_TRANSPOSED
#endif
#undef DOT_KERNEL
#undef DOT_TARGET
#undef DOT_ROWS
#undef DOT
#undef DOT_ACC
#undef DOT_ZERO
#undef DOT_OUT
#undef DOT_STORE
#endif

/* whether this module runs the bfloat16 kernel on this CPU (else lamina_bf16_gemm does nothing) */
static inline int lamina_bf16_kernel_runs(void) {
#ifdef LAMINA_BF16_KERNEL
    return __builtin_cpu_supports("avx512bf16") && __builtin_cpu_supports("avx512vl");
#else
    return 0;
#endif
}

/* Rows [i0, i1) of u (a's rows in bfloat16, whole pairs, ldu values apart) times panels [p0, p1). */
static void lamina_bf16_gemm(long i0, long i1, long k, long n, const uint16_t *u, long ldu, const uint16_t *packed,
                             long p0, long p1, const lamina_bf16_out *o) {
#ifdef LAMINA_BF16_KERNEL
#ifdef LAMINA_AMX
    if (lamina_amx_on) {
        lamina_bf16_gemm_amx(i0, i1, lamina_bf16_pairs(k), n, (const uint8_t *)u, 2 * ldu, packed, p0, p1, o);
        return;
    }
#endif
    lamina_dot_gemm(lamina_bf16_panel_avx512, i0, i1, lamina_bf16_pairs(k), n, (const uint8_t *)u, 2 * ldu, packed,
                    p0, p1, o);
#else
    (void)i0, (void)i1, (void)k, (void)n, (void)u, (void)ldu, (void)packed, (void)p0, (void)p1, (void)o;
#endif
}

/* The whole product on a team of `threads` (team.h lamina_panels_product): first each member
 * rounds its block of the rows of op(a) (into u: m x ldu values, ldu = 2 · pairs), then each takes
 * its share of the panels, or with by_rows its block of whole row tiles. op(a) is a (m x k), or
 * with trans_a aᵀ (a: k x m), its rows read from a's columns. */
typedef struct {
    long m, k, n, lda, ldu;
    int trans_a;
    const float *a;
    uint16_t *u;
    const uint16_t *packed;
    lamina_bf16_out out;
} lamina_bf16_job;

static void lamina_bf16_job_rows(void *job, long i0, long i1) {
    const lamina_bf16_job *j = job;
    if (j->trans_a)
        lamina_bf16_rows_of_columns(j->a, j->lda, j->k, i0, i1, j->u, j->ldu);
    else
        for (long i = i0; i < i1; i++)
            lamina_bf16_row(j->a + i * j->lda, j->k, j->u + i * j->ldu);
}

static void lamina_bf16_job_part(void *job, long r0, long r1, long q0, long q1) {
    const lamina_bf16_job *j = job;
    lamina_bf16_gemm(r0, r1, j->k, j->n, j->u, j->ldu, j->packed, q0, q1, &j->out);
}

static void lamina_bf16_product_team(long m, long k, long n, const float *a, long lda, int trans_a, uint16_t *u,
                                     long ldu, const uint16_t *packed, lamina_bf16_out out, int threads,
                                     int by_rows) {
    lamina_bf16_job job = {m, k, n, lda, ldu, trans_a, a, u, packed, out};
    lamina_panels_product product = {&job, m, lamina_dot_tile_rows(BF16_MR), lamina_bf16_panels(n), by_rows,
                                     lamina_bf16_job_rows, lamina_bf16_job_part};
    lamina_panels_product_team(product, threads);
}

#endif
