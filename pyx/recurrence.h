/* The forward and backward recurrences of RNN, LSTM and GRU, each one call per thread of a team
 * (float and double).
 *
 * Stepping from Python, each step is a packed GEMM that wakes a team of threads and a cell pass
 * on one thread: at 2 threads a 512-wide plain RNN ran its steps at half the machine's GEMM
 * rate. Here each thread t of nt runs every step of the sequence batch in one call, computing
 * the recurrent product and the cell for its share (lamina_share: a set of sequences, or a
 * block of hidden units with a spin barrier per step). The caller starts the nt calls at once
 * on threads of its own (lamina.threads.run_team), with one barrier {0, 0} for all of them.
 *
 * Buffers as in lamina.layers.recurrent: g [total, G·H] (input projections in, activated gates
 * out), hh [total, 3H] (GRU: h_prev W_hhᵀ + b_hh, kept for backward), hs and cs [total, H],
 * step s holding rows starts[s] .. starts[s + 1], the first rows of step s - 1 being the
 * previous states of step s's rows; init_h / init_c: the sorted initial states or NULL (zero). */
#ifndef LAMINA_RECURRENCE_H
#define LAMINA_RECURRENCE_H

#include <math.h>
#include <sched.h>
#include <string.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "cells.h"
#include "convert.h"
#include "int8_panels.h"
#include "bf16_panels.h"
#include "panels.h"
#include "quantize.h"
#include "team.h"

enum { LAMINA_RNN_TANH = 0, LAMINA_RNN_RELU = 1, LAMINA_LSTM = 2, LAMINA_GRU = 3 };

/* A sense-reversing barrier that spins (a step is tens to hundreds of microseconds; waking a
 * sleeping thread costs about as much), yielding the core after a while in case it is shared. */
typedef struct { int count, sense; } lamina_spin_barrier;

static inline void lamina_spin_wait(lamina_spin_barrier *b, int threads, int *sense) {
    int mine = *sense = !*sense;
    if (__atomic_add_fetch(&b->count, 1, __ATOMIC_ACQ_REL) == threads) {
        __atomic_store_n(&b->count, 0, __ATOMIC_RELAXED);
        __atomic_store_n(&b->sense, mine, __ATOMIC_RELEASE);
        return;
    }
    for (long spins = 0; __atomic_load_n(&b->sense, __ATOMIC_ACQUIRE) != mine; spins++) {
        if (spins > (1 << 14)) {
            sched_yield();
        } else {
#if defined(__x86_64__)
            _mm_pause();
#endif
        }
    }
}

/* What thread t of nt does. By rows (sequences): thread t takes the running
 * sequences t, t + T, t + 2T, ... of every step (rows first, first + stride, ...), all units;
 * a sequence's previous state is its own row of the step before, so the threads never wait on
 * each other. By units: every row, the thread's block [u0, u0 + width) of hidden units (whole
 * panels), with a barrier per step, since the next step reads every unit; for batches too
 * small to share by rows (a single sequence, in serving). */
typedef struct { long first, stride, u0, width; int by_rows; } lamina_share;

static inline lamina_share lamina_share_of(int by_rows, long H, long NR, long t, long nt) {
    lamina_share sh = {0, 1, 0, H, by_rows};
    if (nt == 1)
        return sh;
    if (by_rows) {
        sh.first = t;
        sh.stride = nt;
    } else {
        long panels = H / NR, q0 = t * panels / nt, q1 = (t + 1) * panels / nt;
        sh.u0 = q0 * NR;
        sh.width = (q1 - q0) * NR;
    }
    return sh;
}

/* rows of a step of b rows that the thread takes */
static inline long lamina_share_rows(const lamina_share *sh, long b) {
    return b > sh->first ? (b - sh->first + sh->stride - 1) / sh->stride : 0;
}

/* The left operand of the recurrent product in a reduced precision (lamina.precision), which a
 * float32 product then multiplies: each state rounded to bfloat16 (LAMINA_REDUCE_BFLOAT16), or a
 * row snapped to its u8 grid of `levels` steps (LAMINA_REDUCE_INT8), the values an int8 product
 * would multiply. Or a product in that precision itself: the states quantized to u8 rows and
 * multiplied by W_hh's int8 panels (LAMINA_REDUCE_INT8_PANELS, int8_panels.h; forward only), or
 * rounded to bfloat16 and multiplied by its bfloat16 panels (LAMINA_REDUCE_BF16_PANELS,
 * bf16_panels.h; forward, and backward, where dG's rows are rounded and W_hh's panels are W_hh's
 * own, G·H deep).
 * Reduced precision is float32's: the double form only copies (never asked to reduce: the caller
 * refuses it). */
enum {
    LAMINA_REDUCE_NONE = 0, LAMINA_REDUCE_BFLOAT16 = 1, LAMINA_REDUCE_INT8 = 2, LAMINA_REDUCE_INT8_PANELS = 3,
    LAMINA_REDUCE_BF16_PANELS = 4
};

/* what reduces the recurrent product's left operand: kind (LAMINA_REDUCE_*), the u8 grid's steps,
 * and per thread of the team a scratch of `per_thread` values (a step's rows times the operand's
 * width: H forward, G·H backward). For the panels' kinds: W_hh's panels (int8: with their channels'
 * scales and integer sums), and per thread `per_thread` bytes of scratch: `rows` rows of ldu bytes
 * (u8, or bfloat16 values), then (int8) their scales (float) and zero points (int32). */
typedef struct {
    int kind, levels;
    long per_thread;
    void *scratch;
    const void *panels;
    const float *col_scale;
    const int32_t *col_sum;
    long rows, ldu;
} lamina_reduction;

static void lamina_reduce_row_f(int reduce, int levels, const float *x, long n, float *out) {
    if (reduce == LAMINA_REDUCE_INT8) {
        lamina_snap_row(x, n, levels, 0, out);
        return;
    }
    for (long j = 0; j < n; j++)
        out[j] = lamina_round_bfloat16(x[j]);
}

static void lamina_reduce_row_d(int reduce, int levels, const double *x, long n, double *out) {
    (void)reduce, (void)levels;
    memcpy(out, x, sizeof(double) * n);
}

/* c[rows of the share] (+ beta c) = the share's rows of a (float32, k wide, lda apart: the states
 * forward, dG backward), as u8 rows times W_hh's int8 panels or as bfloat16 times its bfloat16
 * panels (rd->kind; both of DOT_NR channels, dot_panels.h), for the share's units of each of
 * `blocks` column blocks of H (G gates forward, 1 for dh_prev; by rows: every unit) */
static void lamina_panels_share_product_f(const lamina_share *sh, long b, long k, long H, long blocks, const float *a,
                                          long lda, const lamina_reduction *rd, int t, float *c, long ldc,
                                          float beta) {
    const long m = lamina_share_rows(sh, b), n = blocks * H;
    if (m == 0 || sh->width == 0)
        return;
    const int int8 = rd->kind == LAMINA_REDUCE_INT8_PANELS;
    uint8_t *u = (uint8_t *)rd->scratch + t * rd->per_thread;
    float *row_scale = (float *)(u + rd->rows * rd->ldu);
    int32_t *zero = (int32_t *)(row_scale + rd->rows);
    for (long i = 0; i < m; i++) {
        const float *row = a + (sh->first + i * sh->stride) * lda;
        if (int8)
            lamina_int8_quantize_row(row, k, rd->levels, u + i * rd->ldu, rd->ldu, &row_scale[i], &zero[i]);
        else
            lamina_bf16_row(row, k, (uint16_t *)(u + i * rd->ldu));
    }
    lamina_int8_out o8 = {row_scale, zero, rd->col_scale, NULL, rd->col_sum, beta, c + sh->first * ldc,
                          sh->stride * ldc};
    lamina_bf16_out o16 = {1.0f, beta, NULL, c + sh->first * ldc, sh->stride * ldc};
    for (long q = 0; q < (sh->width == H ? 1 : blocks); q++) {  /* (every unit: all panels at once) */
        const long p0 = sh->width == H ? 0 : (q * H + sh->u0) / DOT_NR;
        const long p1 = sh->width == H ? (n + DOT_NR - 1) / DOT_NR : (q * H + sh->u0 + sh->width) / DOT_NR;
        if (int8)
            lamina_int8_gemm(0, m, k, n, u, rd->ldu, rd->panels, p0, p1, &o8);
        else
            lamina_bf16_gemm(0, m, k, n, (const uint16_t *)u, rd->ldu / 2, rd->panels, p0, p1, &o16);
    }
}

/* (the double recurrence never reduces) */
static void lamina_panels_share_product_d(const lamina_share *sh, long b, long k, long H, long blocks, const double *a,
                                          long lda, const lamina_reduction *rd, int t, double *c, long ldc,
                                          double beta) {
    (void)sh, (void)b, (void)k, (void)H, (void)blocks, (void)a, (void)lda, (void)rd, (void)t, (void)c, (void)ldc,
        (void)beta;
}

#define LAMINA_IMPL "recurrence_impl.h"
#include "instantiate.h"

#endif
