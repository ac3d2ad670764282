# cython: language_level=3
"""MKL provider: GEMM (float32/float64) and packed GEMM, with the GNU OpenMP threading layer.

Only this module includes mkl.h (its enums clash with OpenBLAS's cblas.h). Shapes are checked by
the caller (lamina.backends.cpu); every entry point here releases the GIL.
"""
from libc.stdint cimport uintptr_t

cdef extern from "mkl.h" nogil:
    ctypedef enum CBLAS_LAYOUT:
        CblasRowMajor
    ctypedef enum CBLAS_TRANSPOSE:
        CblasNoTrans
        CblasTrans
    ctypedef enum CBLAS_IDENTIFIER:
        CblasAMatrix
        CblasBMatrix
    ctypedef enum CBLAS_STORAGE:
        CblasPacked
    int MKL_THREADING_GNU
    int MKL_Set_Threading_Layer(int code)
    void mkl_set_num_threads(int n)
    int mkl_get_max_threads()
    void mkl_get_version_string(char* buf, int len)
    void* mkl_malloc(size_t size, int align)
    void mkl_free(void* ptr)
    int ROW_MAJOR "CblasRowMajor"
    int NO_TRANS "CblasNoTrans"
    int TRANS "CblasTrans"
    void sgemm_ "cblas_sgemm"(int layout, int trans_a, int trans_b, int m, int n, int k,
                              float alpha, const float* a, int lda, const float* b, int ldb,
                              float beta, float* c, int ldc)
    void dgemm_ "cblas_dgemm"(int layout, int trans_a, int trans_b, int m, int n, int k,
                              double alpha, const double* a, int lda, const double* b, int ldb,
                              double beta, double* c, int ldc)
    size_t cblas_sgemm_pack_get_size(CBLAS_IDENTIFIER, int m, int n, int k)
    size_t cblas_dgemm_pack_get_size(CBLAS_IDENTIFIER, int m, int n, int k)
    void cblas_sgemm_pack(CBLAS_LAYOUT, CBLAS_IDENTIFIER, CBLAS_TRANSPOSE, int m, int n, int k,
                          float alpha, const float* src, int ld, float* dest)
    void cblas_dgemm_pack(CBLAS_LAYOUT, CBLAS_IDENTIFIER, CBLAS_TRANSPOSE, int m, int n, int k,
                          double alpha, const double* src, int ld, double* dest)
    void cblas_sgemm_compute(CBLAS_LAYOUT, int transa, int transb, int m, int n, int k,
                             const float* a, int lda, const float* b, int ldb,
                             float beta, float* c, int ldc)
    void cblas_dgemm_compute(CBLAS_LAYOUT, int transa, int transb, int m, int n, int k,
                             const double* a, int lda, const double* b, int ldb,
                             double beta, double* c, int ldc)
    # bfloat16 operands (MKL_BF16: the upper 16 bits of a float32), float32 accumulation
    size_t cblas_gemm_bf16bf16f32_pack_get_size(CBLAS_IDENTIFIER, int m, int n, int k)
    void cblas_gemm_bf16bf16f32_pack(CBLAS_LAYOUT, CBLAS_IDENTIFIER, CBLAS_TRANSPOSE, int m, int n, int k,
                                     const unsigned short* src, int ld, unsigned short* dest)
    void cblas_gemm_bf16bf16f32_compute(CBLAS_LAYOUT, int transa, int transb, int m, int n, int k,
                                        float alpha, const unsigned short* a, int lda, const unsigned short* b,
                                        int ldb, float beta, float* c, int ldc)
    void cblas_gemm_bf16bf16f32(CBLAS_LAYOUT, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, int m, int n, int k, float alpha,
                                const unsigned short* a, int lda, const unsigned short* b, int ldb, float beta,
                                float* c, int ldc)
    # u8 (left) times s8 (right), int32 accumulation; C += an offset (here always 0)
    ctypedef enum CBLAS_OFFSET:
        CblasFixOffset
    size_t cblas_gemm_s8u8s32_pack_get_size(CBLAS_IDENTIFIER, int m, int n, int k)
    void cblas_gemm_s8u8s32_pack(CBLAS_LAYOUT, CBLAS_IDENTIFIER, CBLAS_TRANSPOSE, int m, int n, int k,
                                 const void* src, int ld, void* dest)
    void cblas_gemm_s8u8s32_compute(CBLAS_LAYOUT, int transa, int transb, CBLAS_OFFSET, int m, int n, int k,
                                    float alpha, const void* a, int lda, signed char oa, const void* b, int ldb,
                                    signed char ob, float beta, int* c, int ldc, const int* oc)
    void cblas_gemm_s8u8s32(CBLAS_LAYOUT, CBLAS_TRANSPOSE, CBLAS_TRANSPOSE, CBLAS_OFFSET, int m, int n, int k,
                            float alpha, const void* a, int lda, signed char oa, const void* b, int ldb,
                            signed char ob, float beta, int* c, int ldc, const int* oc)

# Must run before the first MKL call: MKL then threads with gcc's libgomp, the same OpenMP
# runtime as the Cython kernels, so the two never oversubscribe the cores.
threading_layer = MKL_Set_Threading_Layer(MKL_THREADING_GNU)

include "gemm.pxi"


def set_num_threads(int n):
    mkl_set_num_threads(n)


def get_num_threads():
    return mkl_get_max_threads()


def version():
    cdef char buf[256]
    mkl_get_version_string(buf, 256)
    return buf.decode().strip()


cdef class PackedB:
    """The right-hand operand op(B)·alpha of a GEMM in MKL's packed format.

    The buffer comes from mkl_malloc and never moves. It is a snapshot of B's values when
    `pack` ran: whoever owns it must repack when B changes (lamina.backends.cpu.PackCache).
    """
    cdef void* buf
    cdef readonly int k, n, itemsize, max_m
    cdef readonly bint trans
    cdef readonly double alpha

    def __cinit__(self):
        self.buf = NULL

    def __dealloc__(self):
        if self.buf != NULL:
            mkl_free(self.buf)

    @property
    def address(self):
        """Where the packed data starts (for product_functions' callers; valid while this lives)."""
        return <uintptr_t>self.buf

    @property
    def nbytes(self):
        if self.itemsize == 1:
            return cblas_gemm_s8u8s32_pack_get_size(CblasBMatrix, self.max_m, self.n, self.k)
        if self.itemsize == 2:
            return cblas_gemm_bf16bf16f32_pack_get_size(CblasBMatrix, self.max_m, self.n, self.k)
        if self.itemsize == 4:
            return cblas_sgemm_pack_get_size(CblasBMatrix, self.max_m, self.n, self.k)
        return cblas_dgemm_pack_get_size(CblasBMatrix, self.max_m, self.n, self.k)


def pack_b(real[:, ::1] b, bint trans, double alpha, int max_m):
    """Pack op(b)·alpha (shape k×n) for products with up to max_m rows on the left."""
    cdef PackedB p = PackedB()
    cdef int k = b.shape[1] if trans else b.shape[0]
    cdef int n = b.shape[0] if trans else b.shape[1]
    cdef size_t size
    p.k, p.n, p.trans, p.alpha, p.max_m = k, n, trans, alpha, max(max_m, 1)
    p.itemsize = sizeof(real)
    if real is float:
        size = cblas_sgemm_pack_get_size(CblasBMatrix, p.max_m, n, k)
    else:
        size = cblas_dgemm_pack_get_size(CblasBMatrix, p.max_m, n, k)
    p.buf = mkl_malloc(size, 64)
    if p.buf == NULL:
        raise MemoryError(f"mkl_malloc could not allocate {size} bytes for a packed matrix")
    with nogil:
        if real is float:
            cblas_sgemm_pack(CblasRowMajor, CblasBMatrix, <CBLAS_TRANSPOSE>_t(trans), p.max_m, n, k, <float>alpha,
                             &b[0, 0], b.shape[1], <float*>p.buf)
        else:
            cblas_dgemm_pack(CblasRowMajor, CblasBMatrix, <CBLAS_TRANSPOSE>_t(trans), p.max_m, n, k, alpha,
                             &b[0, 0], b.shape[1], <double*>p.buf)
    return p


def packed_gemm(real[:, ::1] a, PackedB p, real[:, ::1] c, double beta):
    """c = a @ P + beta * c where P = alpha·op(B) was packed by pack_b; a has at most max_m rows."""
    cdef int m = a.shape[0]
    if m == 0:
        return
    with nogil:
        if real is float:
            cblas_sgemm_compute(CblasRowMajor, CblasNoTrans, CblasPacked, m, p.n, p.k,
                                &a[0, 0], a.shape[1], <float*>p.buf, p.n, <float>beta, &c[0, 0], p.n)
        else:
            cblas_dgemm_compute(CblasRowMajor, CblasNoTrans, CblasPacked, m, p.n, p.k,
                                &a[0, 0], a.shape[1], <double*>p.buf, p.n, beta, &c[0, 0], p.n)


cdef void _bf16_product(int m, int n, int k, float alpha, const unsigned short* a, const void* packed, float beta,
                        float* c) noexcept nogil:
    cblas_gemm_bf16bf16f32_compute(CblasRowMajor, CblasNoTrans, CblasPacked, m, n, k, alpha, a, k,
                                   <const unsigned short*>packed, n, beta, c, n)


cdef void _u8s8_product(int m, int n, int k, const unsigned char* a, const void* packed, int* c) noexcept nogil:
    cdef int zero = 0
    cblas_gemm_s8u8s32_compute(CblasRowMajor, CblasNoTrans, CblasPacked, CblasFixOffset, m, n, k, 1.0, a, k, 0,
                               packed, n, 0, 0.0, c, n, &zero)


def pack_b_bf16(const unsigned short[:, ::1] b, bint trans, double alpha, int max_m):
    """Pack op(b) (bfloat16 bits, shape k×n) for bfloat16 products with up to max_m rows on the
    left; alpha multiplies at compute time (MKL's bfloat16 pack takes none)."""
    cdef PackedB p = PackedB()
    cdef int k = b.shape[1] if trans else b.shape[0]
    cdef int n = b.shape[0] if trans else b.shape[1]
    cdef size_t size
    p.k, p.n, p.trans, p.alpha, p.max_m, p.itemsize = k, n, trans, alpha, max(max_m, 1), 2
    size = cblas_gemm_bf16bf16f32_pack_get_size(CblasBMatrix, p.max_m, n, k)
    p.buf = mkl_malloc(size, 64)
    if p.buf == NULL:
        raise MemoryError(f"mkl_malloc could not allocate {size} bytes for a packed matrix")
    with nogil:
        cblas_gemm_bf16bf16f32_pack(CblasRowMajor, CblasBMatrix, <CBLAS_TRANSPOSE>_t(trans), p.max_m, n, k,
                                    &b[0, 0], b.shape[1], <unsigned short*>p.buf)
    return p


def packed_gemm_bf16(const unsigned short[:, ::1] a, PackedB p, float[:, ::1] c, float beta):
    """c = alpha · a @ op(B) + beta · c, a and B bfloat16 (B packed by pack_b_bf16), c float32."""
    cdef int m = a.shape[0]
    if m == 0:
        return
    with nogil:
        _bf16_product(m, p.n, p.k, <float>p.alpha, &a[0, 0], p.buf, beta, &c[0, 0])


def gemm_bf16(const unsigned short[:, ::1] a, const unsigned short[:, ::1] b, float[:, :] c, bint trans_a,
              bint trans_b, float alpha, float beta):
    """c = alpha op(a) @ op(b) + beta c, a and b bfloat16 bits, c float32 whose rows may be strided
    (a block of columns); the caller checked the shapes."""
    cdef int m = c.shape[0], n = c.shape[1]
    cdef int k = a.shape[0] if trans_a else a.shape[1]
    cdef int ldc = max(c.strides[0] // sizeof(float), c.shape[1], 1)
    if m == 0 or n == 0:
        return
    with nogil:
        cblas_gemm_bf16bf16f32(CblasRowMajor, <CBLAS_TRANSPOSE>_t(trans_a), <CBLAS_TRANSPOSE>_t(trans_b), m, n, k,
                               alpha, &a[0, 0], max(a.shape[1], 1), &b[0, 0], max(b.shape[1], 1), beta, &c[0, 0], ldc)


def pack_b_s8(const signed char[:, ::1] b, int max_m):
    """Pack bᵀ (b int8 of shape n×k: a weight's output channels are its rows) as the signed right
    operand of u8 x s8 products with up to max_m rows on the left."""
    cdef PackedB p = PackedB()
    cdef int n = b.shape[0], k = b.shape[1]
    cdef size_t size
    p.k, p.n, p.trans, p.alpha, p.max_m, p.itemsize = k, n, True, 1.0, max(max_m, 1), 1
    size = cblas_gemm_s8u8s32_pack_get_size(CblasBMatrix, p.max_m, n, k)
    p.buf = mkl_malloc(size, 64)
    if p.buf == NULL:
        raise MemoryError(f"mkl_malloc could not allocate {size} bytes for a packed matrix")
    with nogil:
        cblas_gemm_s8u8s32_pack(CblasRowMajor, CblasBMatrix, CblasTrans, p.max_m, n, k, &b[0, 0], k, p.buf)
    return p


def packed_gemm_u8s8(const unsigned char[:, ::1] a, PackedB p, int[:, ::1] c):
    """c = a @ B in int32, a u8 (m×k) and B the int8 matrix packed by pack_b_s8."""
    cdef int m = a.shape[0]
    if m == 0:
        return
    with nogil:
        _u8s8_product(m, p.n, p.k, &a[0, 0], p.buf, &c[0, 0])


def u8s8_sums_exact():
    """Whether MKL's u8 x s8 product sums 255 x 127 pairs without saturating: true where the CPU
    has an int8 dot product (VNNI, AMX) and MKL uses it; the older AVX2 and AVX-512 paths add
    pairs of products in int16, which saturate unless the u8 operand stays below 128."""
    cdef unsigned char a[64]
    cdef signed char b[64]
    cdef int c = 0, zero = 0, i
    for i in range(64):
        a[i], b[i] = 255, 127
    with nogil:
        cblas_gemm_s8u8s32(CblasRowMajor, CblasNoTrans, CblasNoTrans, CblasFixOffset, 1, 1, 64, 1.0,
                           a, 64, 0, b, 1, 0, 0.0, &c, 1, &zero)
    return c == 255 * 127 * 64


def product_functions():
    """The addresses of two C functions over packs made here, for compiled loops elsewhere (the
    reduced-precision recurrence of lamina.backends.cpu._kernels), which call them without the GIL:
    bfloat16 `void (int m, int n, int k, float alpha, const uint16 *a, const void *pack, float beta,
    float *c)`, c = alpha a @ P + beta c; int8 `void (int m, int n, int k, const uint8 *a,
    const void *pack, int32 *c)`, c = a @ P."""
    return <uintptr_t>&_bf16_product, <uintptr_t>&_u8s8_product
