# cython: language_level=3
"""OpenBLAS provider (scipy-openblas32: CBLAS symbols prefixed `scipy_`, so it never clashes
with MKL in the same process). Shapes are checked by the caller; the GIL is released."""

cdef extern from "cblas.h" nogil:
    ctypedef enum CBLAS_ORDER:
        CblasRowMajor
    ctypedef enum CBLAS_TRANSPOSE:
        CblasNoTrans
        CblasTrans
    void scipy_cblas_sgemm(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int m, int n, int k,
                           float alpha, const float* a, int lda, const float* b, int ldb,
                           float beta, float* c, int ldc)
    void scipy_cblas_dgemm(CBLAS_ORDER, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int m, int n, int k,
                           double alpha, const double* a, int lda, const double* b, int ldb,
                           double beta, double* c, int ldc)
    void scipy_openblas_set_num_threads(int n)
    int scipy_openblas_get_num_threads()
    char* scipy_openblas_get_config()

ctypedef fused real:
    float
    double


def set_num_threads(int n):
    scipy_openblas_set_num_threads(n)


def get_num_threads():
    return scipy_openblas_get_num_threads()


def version():
    return scipy_openblas_get_config().decode().strip()


cdef inline CBLAS_TRANSPOSE _t(bint trans) noexcept nogil:
    return CblasTrans if trans else CblasNoTrans


def gemm(real[:, ::1] a, real[:, ::1] b, real[:, ::1] c, bint trans_a, bint trans_b,
         double alpha, double beta):
    """c = alpha * op(a) @ op(b) + beta * c  (row-major, shapes checked by the caller)."""
    cdef int m = c.shape[0], n = c.shape[1]
    cdef int k = a.shape[0] if trans_a else a.shape[1]
    if m == 0 or n == 0:
        return
    with nogil:
        if real is float:
            scipy_cblas_sgemm(CblasRowMajor, _t(trans_a), _t(trans_b), m, n, k, <float>alpha,
                              &a[0, 0] if k else NULL, a.shape[1], &b[0, 0] if k else NULL,
                              b.shape[1], <float>beta, &c[0, 0], n)
        else:
            scipy_cblas_dgemm(CblasRowMajor, _t(trans_a), _t(trans_b), m, n, k, alpha,
                              &a[0, 0] if k else NULL, a.shape[1], &b[0, 0] if k else NULL,
                              b.shape[1], beta, &c[0, 0], n)
