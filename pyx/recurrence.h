/* The forward recurrence of RNN, LSTM and GRU as one parallel region (float and double).
 *
 * Stepping from Python, each step is a packed GEMM that wakes a team of threads and a cell pass
 * on one thread: at 2 threads a 512-wide plain RNN ran its steps at half the machine's GEMM
 * rate. Here the threads stay in one region for the whole sequence batch. Thread t owns a block
 * of hidden units (whole panels of NR units, NR = 16 floats or 8 doubles): at each step it
 * computes the recurrent product for its units' columns of every gate (the panels of W_hhᵀ
 * holding them), applies the cell to those units of every running row, and waits at a spin
 * barrier, since the next step reads every unit of this one. No thread reads what another
 * writes within a step, so the barrier is the only synchronisation.
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
#include <omp.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif
#include "cells.h"
#include "panels.h"

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

/* The calling thread's block of hidden-unit panels [q0, q1) out of `panels`, the threads of the
 * region taking equal shares in order. */
static inline void lamina_unit_block(long panels, long *q0, long *q1) {
    long t = omp_get_thread_num(), nt = omp_get_num_threads();
    *q0 = t * panels / nt;
    *q1 = (t + 1) * panels / nt;
}

#define SUFFIXED_(name, sfx) name##_##sfx
#define SUFFIXED2(name, sfx) SUFFIXED_(name, sfx)

#define REAL float
#define LANES 8
#define TANH lamina_fast_tanhf
#define SUFFIXED(name) SUFFIXED2(name, f)
#include "recurrence_impl.h"
#undef REAL
#undef LANES
#undef TANH
#undef SUFFIXED

#define REAL double
#define LANES 4
#define TANH tanh
#define SUFFIXED(name) SUFFIXED2(name, d)
#include "recurrence_impl.h"
#undef REAL
#undef LANES
#undef TANH
#undef SUFFIXED

#endif
