/* LAMINA_CLONES marks the hot loops, the functions that gain from wide vectors and FMA:
 * - by default gcc compiles each twice (target_clones), for x86-64-v3 (AVX2 + FMA) and for the
 *   baseline, and the loader picks the one the CPU runs (the build keeps the portable baseline,
 *   no -march=native);
 * - with LAMINA_TARGET_V4 (the _avx512 modules) each is compiled for x86-64-v4 (AVX-512) alone;
 *   everything else in the module is baseline code, so importing it is safe on any x86-64 CPU
 *   (lamina runs these functions only where the CPU has AVX-512: backends/cpu/compiled.py);
 * - with LAMINA_NO_CLONES alone (the _baseline modules) they are baseline code. */
#ifndef LAMINA_CLONES_H
#define LAMINA_CLONES_H

#if defined(__x86_64__) && defined(__GNUC__) && defined(LAMINA_TARGET_V4)
#define LAMINA_CLONES __attribute__((target("arch=x86-64-v4")))
#elif defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(LAMINA_NO_CLONES)
#define LAMINA_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define LAMINA_CLONES
#endif

#endif
