# GEMM entry points shared by the providers (_mkl.pyx, _openblas.pyx). Before including this,
# a provider declares its library's functions and constants under these Cython names:
#   sgemm_, dgemm_           (cblas_sgemm / scipy_cblas_sgemm …, row-major CBLAS signature)
#   ROW_MAJOR, NO_TRANS, TRANS

ctypedef fused real:
    float
    double


cdef inline int _t(bint trans) noexcept nogil:
    return TRANS if trans else NO_TRANS


def gemm(real[:, :] a, real[:, :] b, real[:, :] c, bint trans_a, bint trans_b,
         double alpha, double beta):
    """c = alpha * op(a) @ op(b) + beta * c, row-major. Rows must be contiguous but may be
    strided (a block of columns of a larger matrix); the caller checks that and the shapes, and
    handles an empty inner dimension."""
    cdef int m = c.shape[0], n = c.shape[1]
    cdef int k = a.shape[0] if trans_a else a.shape[1]
    # leading dimensions: the row strides in elements (at least the row length, for BLAS)
    cdef int lda = max(a.strides[0] // sizeof(real), a.shape[1], 1)
    cdef int ldb = max(b.strides[0] // sizeof(real), b.shape[1], 1)
    cdef int ldc = max(c.strides[0] // sizeof(real), c.shape[1], 1)
    if m == 0 or n == 0:
        return
    with nogil:
        if real is float:
            sgemm_(ROW_MAJOR, _t(trans_a), _t(trans_b), m, n, k, <float>alpha, &a[0, 0], lda,
                   &b[0, 0], ldb, <float>beta, &c[0, 0], ldc)
        else:
            dgemm_(ROW_MAJOR, _t(trans_a), _t(trans_b), m, n, k, alpha, &a[0, 0], lda,
                   &b[0, 0], ldb, beta, &c[0, 0], ldc)
