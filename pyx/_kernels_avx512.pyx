# cython: language_level=3
"""_kernels built for x86-64-v4 (AVX-512) alone: the path LAMINA_ISA=avx512 (and auto, on a CPU that has
it) loads."""
include "_kernels.pyx"
