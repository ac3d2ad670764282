/* LAMINA_CLONES: compile a function twice (gcc's target_clones), for x86-64-v3 (AVX2 + FMA) and
 * for the baseline; the loader picks the one the CPU runs. The build keeps the portable baseline
 * (no -march=native), so the hot loops that gain from 8-wide vectors and FMA say so here.
 * LAMINA_NO_CLONES compiles one target alone, the one the build's flags give: the baseline in the
 * _baseline modules (LAMINA_ISA=baseline), x86-64-v4 (AVX-512) in the _avx512 ones. */
#ifndef LAMINA_CLONES_H
#define LAMINA_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LAMINA_NO_CLONES)
#define LAMINA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LAMINA_CLONES
#endif

#endif
