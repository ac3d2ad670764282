# cython: language_level=3
"""OpenBLAS provider (scipy-openblas32: CBLAS symbols prefixed `scipy_`, so it never clashes
with MKL in the same process). Shapes are checked by the caller; the GIL is released."""

cdef extern from "cblas.h" nogil:
    int ROW_MAJOR "CblasRowMajor"
    int NO_TRANS "CblasNoTrans"
    int TRANS "CblasTrans"
    void sgemm_ "scipy_cblas_sgemm"(int order, int trans_a, int trans_b, int m, int n, int k,
                                    float alpha, const float* a, int lda, const float* b, int ldb,
                                    float beta, float* c, int ldc)
    void dgemm_ "scipy_cblas_dgemm"(int order, int trans_a, int trans_b, int m, int n, int k,
                                    double alpha, const double* a, int lda, const double* b, int ldb,
                                    double beta, double* c, int ldc)
    void scipy_openblas_set_num_threads(int n)
    int scipy_openblas_get_num_threads()
    char* scipy_openblas_get_config()

include "gemm.pxi"

from libc.stdint cimport uintptr_t


def gemm_functions():
    """The addresses of this provider's row-major sgemm and dgemm: the kernels that share one
    product between lamina's team call them (_kernels.gemm_team)."""
    return <uintptr_t>&sgemm_, <uintptr_t>&dgemm_


def set_num_threads(int n):
    scipy_openblas_set_num_threads(n)


def get_num_threads():
    return scipy_openblas_get_num_threads()


def version():
    return scipy_openblas_get_config().decode().strip()
