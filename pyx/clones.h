/* LAMINA_CLONES: compile a function twice (gcc's target_clones), for x86-64-v3 (AVX2 + FMA) and
 * for the baseline; the loader picks the one the CPU runs. The build keeps the portable baseline
 * (no -march=native), so the hot loops that gain from 8-wide vectors and FMA say so here.
 * LAMINA_BASELINE (the _baseline modules, which LAMINA_ISA=baseline loads) compiles the baseline
 * alone. */
#ifndef LAMINA_CLONES_H
#define LAMINA_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LAMINA_BASELINE)
#define LAMINA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LAMINA_CLONES
#endif

#endif
