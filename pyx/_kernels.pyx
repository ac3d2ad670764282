# cython: language_level=3
"""lamina's CPU kernels besides GEMM: bias, activations, softmax, costs, copies, optimizer updates.

Conventions (the same for every backend, see lamina.backends.base):
- arrays are C-contiguous; element-wise kernels take flat 1-D views;
- an output written "with beta" is out = new + beta * out, and beta == 0 never reads out (it may
  hold garbage from an uninitialised buffer), exactly as BLAS treats C;
- shapes and dtypes are checked by the caller (lamina.backends.cpu); here the GIL is released
  and nothing is bounds-checked.
"""
from cython.parallel cimport parallel, prange
from libc.stdint cimport uintptr_t
from libc.stdlib cimport free, malloc
from libc.string cimport memcpy, memset
from libc.math cimport erf, exp, expm1, log, log1p, tanh, sqrt, fabs
cimport openmp

ctypedef fused real:
    float
    double

# below this many elements a loop runs on one thread: starting the team costs more than it saves
cdef enum:
    PARALLEL_MIN = 262144

# recurrent cells: below this many elements one thread is faster (waking the second thread for
# each step costs more than it saves)
cdef enum:
    CELL_PARALLEL_MIN = 65536

# vol2col / col2vol: blocks of the column matrix are sized to stay in cache (about 2^18 values,
# lamina.backends.columns.COL_BLOCK), so they go parallel well below PARALLEL_MIN (at
# PARALLEL_MIN every block ran on one thread)
cdef enum:
    VOLUME_PARALLEL_MIN = 16384

# int8 quantization of rows and the scaling back of their products: a few operations per value,
# worth a second thread from this many values
cdef enum:
    QUANTIZE_PARALLEL_MIN = 65536

# columns per block in bias_grad (a private accumulator of this many values per thread)
cdef enum:
    BIAS_CHUNK = 512

# activation codes, the positions in lamina.backends.base.ACTIVATIONS
cdef enum:
    LINEAR = 0
    SIGMOID = 1
    TANH = 2
    RELU = 3
    LEAKY_RELU = 4
    EXPONENTIAL = 5
    SOFTRELU = 6
    ELU = 7
    SELU = 8
    SOFTSIGN = 9
    HARD_SIGMOID = 10
    GELU = 11
    HARD_SWISH = 12
    GELU_TANH = 13
    BOUNDED_RELU = 14
    SQRT = 15
    RECIPROCAL = 16
    LOG = 17
    ABS = 18
    ERF = 19

# SELU's constants (Klambauer et al.), as in PyTorch and ONNX
cdef double SELU_ALPHA = 1.6732632423543772
cdef double SELU_SCALE = 1.0507009873554805
# √(2/π), the tanh approximation of GELU
cdef double GELU_TANH_C = 0.7978845608028654


def set_num_threads(int n):
    openmp.omp_set_num_threads(n)


def get_num_threads():
    return openmp.omp_get_max_threads()


cdef extern from "<sched.h>" nogil:
    int sched_getcpu()


def current_cpu():
    """The CPU the calling thread runs on now (-1 where the system cannot say)."""
    return sched_getcpu()


cdef extern from *:
    """
    #include <sched.h>
    #include <time.h>
    /* Spin until *counter >= target or `seconds` have passed, yielding the CPU at every turn to
     * any other thread that is ready to run on it; 1 if the target was reached. */
    static int lamina_spin_until(volatile long *counter, long target, double seconds) {
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        for (;;) {
            for (int i = 0; i < 64; i++) {
                if (__atomic_load_n(counter, __ATOMIC_ACQUIRE) >= target)
                    return 1;
    #if defined(__x86_64__) || defined(__i386__)
                __builtin_ia32_pause();
    #endif
            }
            clock_gettime(CLOCK_MONOTONIC, &t);
            if ((t.tv_sec - t0.tv_sec) + 1e-9 * (t.tv_nsec - t0.tv_nsec) >= seconds)
                return 0;
            sched_yield();
        }
    }
    static inline void lamina_count_up(long *counter) { __atomic_add_fetch(counter, 1, __ATOMIC_RELEASE); }
    """
    int lamina_spin_until(long* counter, long target, double seconds) nogil
    void lamina_count_up(long* counter) nogil


def spin_until(long[::1] counter, long target, double seconds):
    """Wait, without the GIL and without sleeping, until counter[0] >= target (True) or `seconds`
    have passed (False); the CPU goes to any other thread ready to run on it meanwhile."""
    if counter.shape[0] != 1:
        raise ValueError(f"spin_until: counter must hold one value, found {counter.shape[0]}")
    cdef int reached
    with nogil:
        reached = lamina_spin_until(&counter[0], target, seconds)
    return bool(reached)


def count_up(long[::1] counter):
    """counter[0] += 1, atomically (the counterpart of spin_until)."""
    if counter.shape[0] != 1:
        raise ValueError(f"count_up: counter must hold one value, found {counter.shape[0]}")
    lamina_count_up(&counter[0])


cdef extern from "team.h" nogil:
    enum: LAMINA_TEAM_MAX
    ctypedef void (*lamina_member)(void* job, int t, int nt) noexcept nogil
    void lamina_team_run(int threads, lamina_member member, void* job)
    void lamina_team_rest()
    void lamina_team_set_spin(double seconds)
    ctypedef void (*lamina_range_body)(void* args, int t, long start, long end) noexcept nogil
    void lamina_team_for(int threads, long n, lamina_range_body body, void* args)


def team_rest():
    """The compiled team's workers (team.h) stop watching for work and sleep until the next team:
    for a caller about to run threads of its own on their CPUs."""
    lamina_team_rest()


def set_team_spin(double seconds):
    """How long the compiled team's workers watch for the next team before they sleep."""
    if not seconds >= 0:
        raise ValueError(f"set_team_spin: seconds must not be negative, found {seconds}")
    lamina_team_set_spin(seconds)


ctypedef struct _roll_call:
    long arrived, seconds_ns, met
    int nt
    int cpus[LAMINA_TEAM_MAX]


cdef void _answer_roll_call(void* job, int t, int nt) noexcept nogil:
    cdef _roll_call* r = <_roll_call*>job
    r.nt = nt
    r.cpus[t] = sched_getcpu()
    lamina_count_up(&r.arrived)
    if lamina_spin_until(&r.arrived, nt, r.seconds_ns * 1e-9):
        lamina_count_up(&r.met)


def team_roll_call(int threads, double seconds=5.0):
    """Run a compiled team (team.h) of `threads` whose members each wait, up to `seconds`, for all
    of them to have started: (team size, members that saw the whole team at once, each member's
    CPU). For tests: a team whose members did not run at the same time answers fewer."""
    if not 1 <= threads <= LAMINA_TEAM_MAX:
        raise ValueError(f"team_roll_call: 1 to {LAMINA_TEAM_MAX} threads, found {threads}")
    cdef _roll_call r
    r.arrived = r.met = 0
    r.seconds_ns = <long>(seconds * 1e9)
    with nogil:
        lamina_team_run(threads, _answer_roll_call, &r)
    return r.nt, r.met, [r.cpus[t] for t in range(r.nt)]


cdef inline double _sigmoid(double x) noexcept nogil:
    if x >= 0:
        return 1.0 / (1.0 + exp(-x))
    cdef double e = exp(x)
    return e / (1.0 + e)


cdef extern from "cells.h" nogil:
    float lamina_fast_tanhf(float x)
    void lstm_row_f(long n, long H, float* g, const float* bias, const float* c_prev, float* c, float* h)
    void lstm_row_d(long n, long H, double* g, const double* bias, const double* c_prev, double* c, double* h)
    void lstm_row_backward_f(long n, long H, const float* g, const float* c_prev, const float* c, const float* dh,
                             const float* dc, float* dg, float* dc_prev)
    void lstm_row_backward_d(long n, long H, const double* g, const double* c_prev, const double* c, const double* dh,
                             const double* dc, double* dg, double* dc_prev)
    void gru_row_f(long n, long H, float* g, const float* bias, const float* hh, const float* h_prev, float* h)
    void gru_row_d(long n, long H, double* g, const double* bias, const double* hh, const double* h_prev, double* h)
    void gru_row_backward_f(long n, long H, const float* g, const float* hh, const float* h_prev, const float* dh,
                            float* dgx, float* dgh, float* dh_prev)
    void gru_row_backward_d(long n, long H, const double* g, const double* hh, const double* h_prev, const double* dh,
                            double* dgx, double* dgh, double* dh_prev)


cdef extern from "panels.h" nogil:
    enum: PANEL_MR "PANEL_MR"
    long panel_count_f(long n)
    long panel_count_d(long n)
    void panel_pack_f(const float* b, long ldb, int trans, long k, long n, float alpha, long p0, long p1,
                      float* out)
    void panel_pack_d(const double* b, long ldb, int trans, long k, long n, double alpha, long p0, long p1,
                      double* out)
    void panel_gemm_f(long m, long k, long n, const float* a, long lda, const float* packed, long p0, long p1,
                      float* c, long ldc, float beta)
    void panel_gemm_d(long m, long k, long n, const double* a, long lda, const double* packed, long p0,
                      long p1, double* c, long ldc, double beta)
    void panel_gemm_team_f(long m, long k, long n, const float* a, long lda, const float* packed, long p0, long p1,
                           float* c, long ldc, float beta, const float* bias, int threads, int by_rows)
    void panel_gemm_team_d(long m, long k, long n, const double* a, long lda, const double* packed, long p0,
                           long p1, double* c, long ldc, double beta, const double* bias, int threads, int by_rows)
    void pointwise_conv_team_f(long cout, long cin, long S, const float* w, const float* x, long ldx, float* y,
                               long ldy, const float* bias, int act, float cap, int threads)
    void pointwise_conv_team_d(long cout, long cin, long S, const double* w, const double* x, long ldx, double* y,
                               long ldy, const double* bias, int act, double cap, int threads)
    void pointwise_positions_team_f(long cout, long cin, long S, const float* packed, const float* x, long ldx,
                                    float* y, long ldy, const float* bias, int act, float cap, int threads)
    void pointwise_positions_team_d(long cout, long cin, long S, const double* packed, const double* x, long ldx,
                                    double* y, long ldy, const double* bias, int act, double cap, int threads)


cdef extern from "amx_tiles.h" nogil:
    int lamina_amx_enable()
    int lamina_amx_on


cdef extern from "int8_panels.h" nogil:
    ctypedef struct lamina_int8_out:
        float* row_scale
        int* zero
        const float* col_scale
        const float* bias
        const int* col_sum
        float beta
        float* c
        long ldc
    long lamina_int8_quads(long k)
    long lamina_int8_panels(long n)
    long lamina_int8_pack_size(long k, long n)
    int lamina_int8_uses_avx2()
    int lamina_int8_uses_vnni()
    void lamina_int8_pack(const signed char* q, long k, long n, long p0, long p1, signed char* out)
    void lamina_int8_product_team(long m, long k, long n, const float* a, long lda, unsigned char* u, long ldu,
                                  const signed char* packed, lamina_int8_out out, int threads, int by_rows)
    int INT8_ACTIVATION_LEVELS


cdef extern from "bf16_panels.h" nogil:
    ctypedef struct lamina_bf16_out:
        float alpha, beta
        const float* bias
        float* c
        long ldc
        int transposed, act
        float cap
    long lamina_bf16_pairs(long k)
    long lamina_bf16_panels(long n)
    long lamina_bf16_pack_size(long k, long n)
    int lamina_bf16_kernel_runs()
    void lamina_bf16_pack_team(const float* b, long k, long n, int trans, unsigned short* out, int threads)
    void lamina_bf16_product_team(long m, long k, long n, const float* a, long lda, int trans_a, unsigned short* u,
                                  long ldu, const unsigned short* packed, lamina_bf16_out out, int threads,
                                  int by_rows)


cdef extern from "recurrence.h" nogil:
    ctypedef struct lamina_reduction:
        int kind, levels
        long per_thread
        void* scratch
        const void* panels
        const float* col_scale
        const int* col_sum
        long rows, ldu
    void recurrence_forward_team_f(int kind, long steps, const long* starts, long H, long G, float* g,
                                   const float* bias, float* hh, const float* b_hh, const float* packed, float* hs,
                                   float* cs, const float* init_h, const float* init_c, float* out, long ldo,
                                   const int* out_rows, int threads, int by_rows, lamina_reduction reduction)
    void recurrence_forward_team_d(int kind, long steps, const long* starts, long H, long G, double* g,
                                   const double* bias, double* hh, const double* b_hh, const double* packed,
                                   double* hs, double* cs, const double* init_h, const double* init_c, double* out,
                                   long ldo, const int* out_rows, int threads, int by_rows,
                                   lamina_reduction reduction)
    void recurrence_backward_team_f(int kind, long steps, const long* starts, long H, long G, const float* g,
                                    const float* hh, const float* hs, const float* cs, float* dhs, float* dcs,
                                    float* dg, float* dgh, const float* packed, const float* init_h,
                                    const float* init_c, float* dh0, float* dc0, int threads, int by_rows,
                                    lamina_reduction reduction)
    void recurrence_backward_team_d(int kind, long steps, const long* starts, long H, long G, const double* g,
                                    const double* hh, const double* hs, const double* cs, double* dhs, double* dcs,
                                    double* dg, double* dgh, const double* packed, const double* init_h,
                                    const double* init_c, double* dh0, double* dc0, int threads, int by_rows,
                                    lamina_reduction reduction)


def fast_tanh(float[::1] x, float[::1] y):
    """y = tanh(x) by the float32 approximation the recurrent cells use (tested against numpy)."""
    cdef Py_ssize_t i
    for i in range(x.shape[0]):
        y[i] = lamina_fast_tanhf(x[i])


cdef inline double _act(int kind, double x, double slope) noexcept nogil:
    if kind == SIGMOID:
        return _sigmoid(x)
    elif kind == TANH:
        return tanh(x)
    elif kind == RELU:  # NaN stays NaN, as in PyTorch
        return 0.0 if x < 0 else x
    elif kind == LEAKY_RELU:
        return slope * x if x < 0 else x
    elif kind == EXPONENTIAL:
        return exp(x)
    elif kind == SOFTRELU:
        # log(1 + e^x) without overflow
        return (x if x > 0 else 0.0) + log1p(exp(-fabs(x)))
    elif kind == ELU:
        return slope * expm1(x) if x < 0 else x
    elif kind == SELU:
        return SELU_SCALE * (SELU_ALPHA * expm1(x) if x < 0 else x)
    elif kind == SOFTSIGN:
        return x / (1.0 + fabs(x))
    elif kind == HARD_SIGMOID:
        return _unit_clip(slope * x + 0.5)
    elif kind == GELU:
        return 0.5 * x * (1.0 + erf(x * 0.7071067811865476))
    elif kind == HARD_SWISH:
        return x * _unit_clip(x / 6.0 + 0.5)
    elif kind == GELU_TANH:
        return 0.5 * x * (1.0 + tanh(GELU_TANH_C * (x + 0.044715 * x * x * x)))
    elif kind == BOUNDED_RELU:  # NaN stays NaN
        return 0.0 if x < 0 else (slope if x > slope else x)
    elif kind == SQRT:
        return sqrt(x)
    elif kind == RECIPROCAL:
        return 1.0 / x
    elif kind == LOG:
        return log(x)
    elif kind == ABS:
        return fabs(x)
    elif kind == ERF:
        return erf(x)
    return x


cdef inline double _unit_clip(double v) noexcept nogil:
    """v clipped to [0, 1] (NaN stays NaN)."""
    return 0.0 if v < 0 else (1.0 if v > 1 else v)


cdef inline double _act_grad_from_output(int kind, double y, double slope) noexcept nogil:
    """f'(x) written with y = f(x), so backward needs only the layer's output."""
    if kind == SIGMOID:
        return y * (1.0 - y)
    elif kind == TANH:
        return 1.0 - y * y
    elif kind == RELU:
        return 1.0 if y > 0 else 0.0
    elif kind == LEAKY_RELU:
        return 1.0 if y > 0 else slope
    elif kind == EXPONENTIAL:
        return y
    elif kind == SOFTRELU:
        # f'(x) = sigmoid(x) = 1 - e^{-y}
        return -expm1(-y)
    elif kind == ELU:
        return 1.0 if y > 0 else y + slope
    elif kind == SELU:
        return SELU_SCALE if y > 0 else y + SELU_SCALE * SELU_ALPHA
    elif kind == SOFTSIGN:
        return (1.0 - fabs(y)) * (1.0 - fabs(y))
    elif kind == HARD_SIGMOID:
        return slope if 0 < y < 1 else 0.0
    elif kind == BOUNDED_RELU:
        return 1.0 if 0 < y < slope else 0.0
    elif kind == GELU:  # y is the input x here (INPUT_GRAD_ACTIVATIONS)
        return 0.5 * (1.0 + erf(y * 0.7071067811865476)) + y * exp(-0.5 * y * y) * 0.3989422804014327
    elif kind == HARD_SWISH:  # y is the input x
        return 0.0 if y < -3 else (1.0 if y > 3 else y / 3.0 + 0.5)
    elif kind == GELU_TANH:  # y is the input x
        return _gelu_tanh_grad(y)
    elif kind == SQRT:
        return 0.5 / y
    elif kind == RECIPROCAL:
        return -y * y
    elif kind == LOG:  # y is the input x
        return 1.0 / y
    elif kind == ABS:  # y is the input x
        return 1.0 if y > 0 else (-1.0 if y < 0 else 0.0)
    elif kind == ERF:  # y is the input x
        return 1.1283791670955126 * exp(-y * y)
    return 1.0


cdef inline double _gelu_tanh_grad(double x) noexcept nogil:
    cdef double t = tanh(GELU_TANH_C * (x + 0.044715 * x * x * x))
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * GELU_TANH_C * (1.0 + 3.0 * 0.044715 * x * x)


cdef extern from "activations.h" nogil:
    float lamina_fast_erff(float x)
    void lamina_erf_activation_f(int kind, const float* x, float* y, long n)
    void lamina_erf_activation_grad_f(int kind, const float* x, const float* dy, float* dx, long n, float beta)


# element-wise kernels share their values among the team's members in spans of this many
cdef enum:
    ELEMENT_SPAN = 8192


def fast_erf(float[::1] x, float[::1] y):
    """y = erf(x) by activations.h's float32 approximation (tested against math.erf)."""
    lamina_erf_activation_f(ERF, &x[0], &y[0], x.shape[0])


ctypedef struct _elementwise_job:
    int kind
    bint single            # float32 arrays (else float64)
    void* x
    void* y
    void* dy
    void* dx
    long n
    double slope, alpha, beta


cdef inline int _threads_for(bint worth) noexcept nogil:
    """The threads a kernel called here may use (lamina's count, 1 inside a split_work piece:
    OpenMP's count per calling thread, which lamina.threads sets) where its work is worth them."""
    return openmp.omp_get_max_threads() if worth else 1


cdef inline void _activate(int kind, const real* x, real* y, long lo, long hi, double slope) noexcept nogil:
    cdef long i
    cdef real cap = <real>slope
    if kind == RELU:  # the common case, as a loop the compiler vectorises (NaN stays NaN)
        for i in range(lo, hi):
            y[i] = 0 if x[i] < 0 else x[i]
    elif kind == BOUNDED_RELU:  # ReLU6, vectorised as ReLU
        for i in range(lo, hi):
            y[i] = 0 if x[i] < 0 else (cap if x[i] > cap else x[i])
    elif real is float and kind == TANH:
        for i in range(lo, hi):
            y[i] = lamina_fast_tanhf(x[i])
    elif real is float and kind == SIGMOID:
        for i in range(lo, hi):
            y[i] = <float>0.5 + <float>0.5 * lamina_fast_tanhf(<float>0.5 * x[i])
    elif real is float and (kind == GELU or kind == GELU_TANH or kind == ERF):
        lamina_erf_activation_f(kind, x + lo, y + lo, hi - lo)
    else:
        for i in range(lo, hi):
            y[i] = <real>_act(kind, x[i], slope)


cdef void _activation_spans(void* args, int t, long s0, long s1) noexcept nogil:
    """activation_forward over the spans s0 .. s1 of ELEMENT_SPAN values."""
    cdef _elementwise_job* j = <_elementwise_job*>args
    cdef long lo = s0 * ELEMENT_SPAN, hi = min(s1 * ELEMENT_SPAN, j.n)
    if j.single:
        _activate(j.kind, <const float*>j.x, <float*>j.y, lo, hi, j.slope)
    else:
        _activate(j.kind, <const double*>j.x, <double*>j.y, lo, hi, j.slope)


cdef inline void _activate_grad(int kind, const real* y, const real* dy, real* dx, long lo, long hi, double slope,
                                double beta) noexcept nogil:
    cdef long i
    cdef real cap = <real>slope
    if kind == RELU and beta == 0:  # vectorised, as the forward
        for i in range(lo, hi):
            dx[i] = dy[i] if y[i] > 0 else 0
    elif kind == BOUNDED_RELU and beta == 0:
        for i in range(lo, hi):
            dx[i] = dy[i] if 0 < y[i] < cap else 0
    elif real is float and (kind == GELU or kind == GELU_TANH or kind == ERF):  # y is the input x
        lamina_erf_activation_grad_f(kind, y + lo, dy + lo, dx + lo, hi - lo, <float>beta)
    elif beta == 0:
        for i in range(lo, hi):
            dx[i] = <real>(dy[i] * _act_grad_from_output(kind, y[i], slope))
    else:
        for i in range(lo, hi):
            dx[i] = <real>(dy[i] * _act_grad_from_output(kind, y[i], slope) + beta * dx[i])


cdef void _activation_grad_spans(void* args, int t, long s0, long s1) noexcept nogil:
    """activation_backward over the spans s0 .. s1 of ELEMENT_SPAN values."""
    cdef _elementwise_job* j = <_elementwise_job*>args
    cdef long lo = s0 * ELEMENT_SPAN, hi = min(s1 * ELEMENT_SPAN, j.n)
    if j.single:
        _activate_grad(j.kind, <const float*>j.y, <const float*>j.dy, <float*>j.dx, lo, hi, j.slope, j.beta)
    else:
        _activate_grad(j.kind, <const double*>j.y, <const double*>j.dy, <double*>j.dx, lo, hi, j.slope, j.beta)


cdef inline bint _vector_erf(int kind, bint single) noexcept nogil:
    return single and (kind == GELU or kind == GELU_TANH or kind == ERF)


def activation_forward(int kind, real[::1] x, real[::1] y, double slope):
    """y = f(x), element-wise (x and y may be the same buffer), on lamina's team of threads
    (team.h) from PARALLEL_MIN values (PARALLEL_MIN / 8 for the vectorised erf). float32 tanh
    and sigmoid use the fast tanh of cells.h, float32 GELU (both forms) and erf activations.h
    (vectorised); everything else libm in double."""
    cdef _elementwise_job j
    j.n = x.shape[0]
    if j.n == 0:
        return
    if kind == BOUNDED_RELU:  # the bound as the values hold it: backward tells it from y
        slope = <real>slope
    j.kind, j.single, j.x, j.y, j.slope = kind, real is float, &x[0], &y[0], slope
    cdef bint worth = j.n > (PARALLEL_MIN // 8 if _vector_erf(kind, j.single) else PARALLEL_MIN)
    with nogil:
        lamina_team_for(_threads_for(worth), (j.n + ELEMENT_SPAN - 1) // ELEMENT_SPAN, _activation_spans, &j)


def activation_backward(int kind, real[::1] y, real[::1] dy, real[::1] dx, double beta, double slope):
    """dx = dy * f'(x) + beta * dx, with f'(x) computed from y = f(x) (the input x for GELU and
    erf), on the team as the forward."""
    cdef _elementwise_job j
    j.n = y.shape[0]
    if j.n == 0:
        return
    if kind == BOUNDED_RELU:
        slope = <real>slope
    j.kind, j.single, j.y, j.dy, j.dx, j.slope, j.beta = kind, real is float, &y[0], &dy[0], &dx[0], slope, beta
    cdef bint worth = j.n > (PARALLEL_MIN // 8 if _vector_erf(kind, j.single) else PARALLEL_MIN)
    with nogil:
        lamina_team_for(_threads_for(worth), (j.n + ELEMENT_SPAN - 1) // ELEMENT_SPAN, _activation_grad_spans, &j)


cdef extern from "softmax.h" nogil:
    double softmax_row_f(const float* x, float* y, long n, int take_log)
    double softmax_row_d(const double* x, double* y, long n, int take_log)


cdef inline double _softmax_row(real* x, real* y, Py_ssize_t n, bint take_log) noexcept nogil:
    if real is float:
        return softmax_row_f(x, y, n, take_log)
    else:
        return softmax_row_d(x, y, n, take_log)


def softmax_forward(real[:, ::1] x, real[:, ::1] y, bint take_log=False):
    """y[i] = exp(x[i] - max x[i]) / sum exp(...), one row at a time; take_log: its log,
    x[i] - max x[i] - log sum exp(x[i] - max x[i]). float rows use softmax.h's fast exp."""
    cdef Py_ssize_t i, rows = x.shape[0], cols = x.shape[1]
    if cols == 0:
        return
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        _softmax_row(&x[i, 0], &y[i, 0], cols, take_log)


def softmax_backward(real[:, ::1] y, real[:, ::1] dy, real[:, ::1] dx, double beta, bint take_log=False):
    """dx = y * (dy - sum(dy * y)) + beta * dx, row-wise; take_log (y = log softmax):
    dx = dy - exp(y) * sum(dy) + beta * dx."""
    cdef Py_ssize_t i, j, rows = y.shape[0], cols = y.shape[1]
    cdef double d, v
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        d = 0
        for j in range(cols):
            d = d + (dy[i, j] if take_log else dy[i, j] * y[i, j])
        for j in range(cols):
            v = dy[i, j] - exp(y[i, j]) * d if take_log else y[i, j] * (dy[i, j] - d)
            dx[i, j] = <real>v if beta == 0 else <real>(v + beta * dx[i, j])


def add_bias(real[:, ::1] y, real[::1] b):
    """y[i, :] += b."""
    cdef Py_ssize_t i, j, rows = y.shape[0], cols = y.shape[1]
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        for j in range(cols):
            y[i, j] += b[j]


ctypedef struct _bias_grad_job:
    bint single            # float32 arrays (else float64)
    const void* dy
    void* db
    long rows, cols
    double beta


cdef inline void _column_sums(const real* dy, real* db, long rows, long cols, long j0, long j1,
                              double beta) noexcept nogil:
    """db[j0:j1] = Σ over rows of dy's columns j0..j1 (+ beta db), in a private accumulator, so the
    inner loop is a plain vectorisable add."""
    cdef real acc[BIAS_CHUNK]
    cdef long i, j
    for j in range(j1 - j0):
        acc[j] = 0
    for i in range(rows):
        for j in range(j1 - j0):
            acc[j] = acc[j] + dy[i * cols + j0 + j]
    for j in range(j0, j1):
        db[j] = acc[j - j0] if beta == 0 else <real>(acc[j - j0] + beta * db[j])


cdef void _bias_grad_chunks(void* args, int t, long c0, long c1) noexcept nogil:
    cdef _bias_grad_job* j = <_bias_grad_job*>args
    cdef long c
    for c in range(c0, c1):
        if j.single:
            _column_sums(<const float*>j.dy, <float*>j.db, j.rows, j.cols, c * BIAS_CHUNK,
                         min((c + 1) * BIAS_CHUNK, j.cols), j.beta)
        else:
            _column_sums(<const double*>j.dy, <double*>j.db, j.rows, j.cols, c * BIAS_CHUNK,
                         min((c + 1) * BIAS_CHUNK, j.cols), j.beta)


def bias_grad(real[:, ::1] dy, real[::1] db, double beta):
    """db = sum over rows of dy + beta * db (column sums): blocks of BIAS_CHUNK columns shared by
    the team from PARALLEL_MIN values (it runs between the team's products)."""
    cdef _bias_grad_job j
    cdef Py_ssize_t c
    j.single, j.rows, j.cols, j.beta = real is float, dy.shape[0], dy.shape[1], beta
    if db.shape[0] != j.cols:
        raise ValueError(f"bias_grad: db must hold {j.cols} values, found {db.shape[0]}")
    if j.cols == 0:
        return
    j.db = &db[0]
    if j.rows == 0:
        for c in range(j.cols):
            db[c] = <real>(0 if beta == 0 else beta * db[c])
        return
    j.dy = &dy[0, 0]
    with nogil:
        lamina_team_for(_threads_for(j.rows * j.cols > PARALLEL_MIN), (j.cols + BIAS_CHUNK - 1) // BIAS_CHUNK,
                        _bias_grad_chunks, &j)


cdef inline void _axpby(double alpha, const real* x, double beta, real* y, long lo, long hi) noexcept nogil:
    cdef long i
    if beta == 0:
        for i in range(lo, hi):
            y[i] = <real>(alpha * x[i])
    else:
        for i in range(lo, hi):
            y[i] = <real>(alpha * x[i] + beta * y[i])


cdef void _axpby_spans(void* args, int t, long s0, long s1) noexcept nogil:
    cdef _elementwise_job* j = <_elementwise_job*>args
    cdef long lo = s0 * ELEMENT_SPAN, hi = min(s1 * ELEMENT_SPAN, j.n)
    if j.single:
        _axpby(j.alpha, <const float*>j.x, j.beta, <float*>j.y, lo, hi)
    else:
        _axpby(j.alpha, <const double*>j.x, j.beta, <double*>j.y, lo, hi)


def axpby(double alpha, real[::1] x, double beta, real[::1] y):
    """y = alpha * x + beta * y (beta == 0 never reads y), on the team from PARALLEL_MIN values."""
    cdef _elementwise_job j
    j.n = x.shape[0]
    if j.n == 0:
        return
    j.single, j.x, j.y, j.alpha, j.beta = real is float, &x[0], &y[0], alpha, beta
    with nogil:
        lamina_team_for(_threads_for(j.n > PARALLEL_MIN), (j.n + ELEMENT_SPAN - 1) // ELEMENT_SPAN, _axpby_spans, &j)


def multiply(real[::1] a, real[::1] b, real[::1] out, double beta):
    """out = a * b + beta * out, element-wise."""
    cdef Py_ssize_t i, n = a.shape[0]
    if beta == 0:
        for i in prange(n, nogil=True, schedule="static", use_threads_if=n > PARALLEL_MIN):
            out[i] = a[i] * b[i]
    else:
        for i in prange(n, nogil=True, schedule="static", use_threads_if=n > PARALLEL_MIN):
            out[i] = <real>(a[i] * b[i] + beta * out[i])


cdef extern from "convert.h" nogil:
    void lamina_to_bfloat16(const float *x, unsigned short *out, long n)
    float lamina_round_bfloat16(float x)


def to_bfloat16(const float[::1] x, unsigned short[::1] out):
    """out = the bfloat16 bits of x, rounded to nearest (ties to even); the threads share it
    from PARALLEL_MIN values."""
    cdef Py_ssize_t n = x.shape[0], t, nt = 1, lo, hi
    if n == 0:
        return
    if n > PARALLEL_MIN:
        nt = openmp.omp_get_max_threads()
    for t in prange(nt, nogil=True, schedule="static", num_threads=nt):
        lo = n * t // nt
        hi = n * (t + 1) // nt
        lamina_to_bfloat16(&x[0] + lo, &out[0] + lo, hi - lo)


ctypedef struct _reduce_job:
    const float* x
    float* y
    long k                         # values per row (round_bfloat16: per span)
    long n                         # values in all
    int levels


cdef void _round_spans(void* args, int t, long s0, long s1) noexcept nogil:
    cdef _reduce_job* j = <_reduce_job*>args
    cdef long i
    for i in range(s0 * ELEMENT_SPAN, min(s1 * ELEMENT_SPAN, j.n)):
        j.y[i] = lamina_round_bfloat16(j.x[i])


def round_bfloat16(const float[::1] x, float[::1] out):
    """out = x rounded to the nearest bfloat16 value (ties to even), as float32; spans of
    ELEMENT_SPAN values shared by the team from PARALLEL_MIN values."""
    cdef _reduce_job j
    j.x, j.n = &x[0] if x.shape[0] else NULL, x.shape[0]
    j.y = &out[0] if out.shape[0] else NULL
    if out.shape[0] != j.n:
        raise ValueError(f"round_bfloat16: out must hold {j.n} values, found {out.shape[0]}")
    if j.n == 0:
        return
    with nogil:
        lamina_team_for(_threads_for(j.n > PARALLEL_MIN), (j.n + ELEMENT_SPAN - 1) // ELEMENT_SPAN, _round_spans, &j)


cdef extern from "quantize.h" nogil:
    void lamina_quantize_row(const float *x, long k, int levels, int symmetric, float *q, float *scale)
    void lamina_quantize_row_u8(const float *x, long k, int levels, unsigned char *u, float *scale, int *zero)
    void lamina_snap_row(const float *x, long k, int levels, int symmetric, float *y)
    void lamina_dequantize_row(const int *c, long n, float row_scale, int zero, const float *col_scale,
                               const int *col_sum, const float *bias, float beta, float *y)


def quantize_rows(const float[:, ::1] x, float[:, ::1] q, float[::1] scales, int levels, bint symmetric):
    """q, scales = each row of x as integers (less the zero point) and its scale
    (lamina.precision.quantize_rows)."""
    cdef Py_ssize_t i, m = x.shape[0], k = x.shape[1]
    for i in prange(m, nogil=True, schedule="static", use_threads_if=m * k > QUANTIZE_PARALLEL_MIN):
        lamina_quantize_row(&x[i, 0], k, levels, symmetric, &q[i, 0], &scales[i])


def snap_rows(const float[:, ::1] x, float[:, ::1] y, int levels):
    """y = each row of x as its u8 grid of `levels` steps holds it (lamina.precision.quantize_rows'
    integers times the row's scale): the left operand of a float32 product computing an int8 one."""
    cdef Py_ssize_t i, m = x.shape[0], k = x.shape[1]
    if y.shape[0] != m or y.shape[1] != k or not 1 <= levels <= 255:
        raise ValueError(f"snap_rows: y must be {m} x {k} and levels in 1..255, found {y.shape[0]} x {y.shape[1]} "
                         f"and {levels}")
    cdef _reduce_job j
    if m == 0 or k == 0:
        return
    j.x, j.y, j.k, j.n, j.levels = &x[0, 0], &y[0, 0], k, m * k, levels
    if x.strides[0] != k * sizeof(float) or y.strides[0] != k * sizeof(float):
        raise ValueError(f"snap_rows: x and y must be C-contiguous rows of {k} floats, found rows "
                         f"{x.strides[0]} and {y.strides[0]} bytes apart")
    with nogil:
        lamina_team_for(_threads_for(m * k > QUANTIZE_PARALLEL_MIN), m, _snap_rows, &j)


cdef void _snap_rows(void* args, int t, long r0, long r1) noexcept nogil:
    cdef _reduce_job* j = <_reduce_job*>args
    cdef long r
    for r in range(r0, r1):
        lamina_snap_row(j.x + r * j.k, j.k, j.levels, 0, j.y + r * j.k)


def quantize_rows_u8(const float[:, ::1] x, unsigned char[:, ::1] u, float[::1] scales, int[::1] zeros, int levels):
    """u, scales, zeros = each row of x as u8 values in [0, levels], its scale and zero point."""
    cdef Py_ssize_t i, m = x.shape[0], k = x.shape[1]
    for i in prange(m, nogil=True, schedule="static", use_threads_if=m * k > QUANTIZE_PARALLEL_MIN):
        lamina_quantize_row_u8(&x[i, 0], k, levels, &u[i, 0], &scales[i], &zeros[i])


def dequantize_rows(const int[:, ::1] c, const float[::1] row_scales, const int[::1] zeros,
                    const float[::1] col_scales, const int[::1] col_sums, float[:, ::1] y, bias, float beta):
    """y[i, j] = row_scales[i] col_scales[j] (c[i, j] - zeros[i] col_sums[j]) + (bias[j], or beta y[i, j])."""
    cdef Py_ssize_t i, m = c.shape[0], n = c.shape[1]
    cdef const float[::1] b
    cdef const float* bp = NULL
    if bias is not None:
        b = bias
        bp = &b[0]
    for i in prange(m, nogil=True, schedule="static", use_threads_if=m * n > QUANTIZE_PARALLEL_MIN):
        lamina_dequantize_row(&c[i, 0], n, row_scales[i], zeros[i], &col_scales[0], &col_sums[0], bp, beta, &y[i, 0])


ctypedef void (*bf16_product_t)(int m, int n, int k, float alpha, const unsigned short* a, const void* packed,
                                float beta, float* c) noexcept nogil
ctypedef void (*u8s8_product_t)(int m, int n, int k, const unsigned char* a, const void* packed, int* c) noexcept nogil

# the cells of the reduced-precision recurrence (lamina.backends.cpu.fused_recurrence.FUSED_CELLS)
cdef enum:
    CELL_RNN_TANH = 0
    CELL_RNN_RELU = 1
    CELL_LSTM = 2
    CELL_GRU = 3

# a step's cells, and its int8 quantization and scaling back, go parallel from this many values
cdef enum:
    REDUCED_CELL_PARALLEL_MIN = 8192


cdef void _reduced_product(const float* h, int rows, int H, int n, const void* packed, float alpha, uintptr_t product,
                           bint int8, unsigned short* bits, unsigned char* u, float* row_scales, int* zeros,
                           int* sums, const float* col_scales, const int* col_sums, int levels, const float* bias,
                           float beta, float* out) noexcept nogil:
    """out = h @ P (+ bias, or + beta out): P (H rows, n columns) the bfloat16 or s8 pack of W_hhᵀ
    multiplied by `product` (lamina.backends.cpu._mkl.product_functions), h's rows rounded to
    bfloat16 or quantized to u8 and the int32 sums scaled back."""
    cdef int r
    if not int8:
        lamina_to_bfloat16(h, bits, <long>rows * H)
        if bias != NULL:
            for r in range(rows):
                memcpy(out + <long>r * n, bias, n * sizeof(float))
            beta = 1.0
        (<bf16_product_t>product)(rows, n, H, alpha, bits, packed, beta, out)
        return
    for r in prange(rows, schedule="static", use_threads_if=rows * H >= REDUCED_CELL_PARALLEL_MIN):
        lamina_quantize_row_u8(h + <long>r * H, H, levels, u + <long>r * H, &row_scales[r], &zeros[r])
    (<u8s8_product_t>product)(rows, n, H, u, packed, sums)
    for r in prange(rows, schedule="static", use_threads_if=rows * n >= REDUCED_CELL_PARALLEL_MIN):
        lamina_dequantize_row(sums + <long>r * n, n, row_scales[r], zeros[r], col_scales, col_sums, bias, beta,
                              out + <long>r * n)


cdef inline float* _first_row(float[:, ::1] a, bint present) noexcept nogil:
    return &a[0, 0] if present else NULL


def recurrence_forward_reduced(int cell, const long[::1] starts, float[:, ::1] g, uintptr_t packed, int n,
                               float alpha, uintptr_t product, bint int8, const float[::1] col_scales,
                               const int[::1] col_sums, int levels, float[:, ::1] hh, const float[::1] b_hh,
                               bint has_b_hh, float[:, ::1] hs, float[:, ::1] cs, bint has_cs,
                               float[:, ::1] init_h, bint has_init_h, float[:, ::1] init_c, bint has_init_c,
                               unsigned short[:, ::1] bits, unsigned char[:, ::1] u, float[::1] row_scales,
                               int[::1] zeros, int[:, ::1] sums):
    """A layer direction's forward with W_hh's products in bfloat16 or int8, every step in one
    call: step t's rows are starts[t]..starts[t + 1] (the sequences still running,
    longest first), the previous states the first rows of step t - 1 (or the initial states). g
    holds x W_ihᵀ + bias and is activated in place (RNN: h = act(g)); GRU's recurrent products,
    with b_hh, go to hh. The caller checked every shape (lamina.backends.cpu.fused_recurrence)."""
    cdef Py_ssize_t steps = starts.shape[0] - 1, t, r, r0, b, j
    cdef int H = hs.shape[1]
    cdef const float* prev
    cdef const float* prev_c
    cdef const float* bias = &b_hh[0] if has_b_hh else NULL
    cdef float* target
    cdef float v
    with nogil:
        for t in range(steps):
            r0 = starts[t]
            b = starts[t + 1] - r0
            if t == 0:
                prev = _first_row(init_h, has_init_h)
                prev_c = _first_row(init_c, has_init_c)
            else:
                prev = &hs[starts[t - 1], 0]
                prev_c = &cs[starts[t - 1], 0] if has_cs else NULL
            target = &hh[r0, 0] if cell == CELL_GRU else &g[r0, 0]
            if prev != NULL:
                _reduced_product(prev, <int>b, H, n, <const void*>packed, alpha, product, int8, &bits[0, 0], &u[0, 0],
                                 &row_scales[0], &zeros[0], &sums[0, 0], &col_scales[0], &col_sums[0], levels,
                                 bias if cell == CELL_GRU else NULL, 0.0 if cell == CELL_GRU else 1.0, target)
            elif cell == CELL_GRU:
                for r in range(b):
                    for j in range(n):
                        target[r * n + j] = bias[j] if bias != NULL else 0.0
            for r in prange(b, schedule="static", use_threads_if=b * H >= REDUCED_CELL_PARALLEL_MIN):
                if cell == CELL_LSTM:
                    lstm_row_f(H, H, &g[r0 + r, 0], NULL, prev_c + r * H if prev_c != NULL else NULL,
                               &cs[r0 + r, 0], &hs[r0 + r, 0])
                elif cell == CELL_GRU:
                    gru_row_f(H, H, &g[r0 + r, 0], NULL, &hh[r0 + r, 0], prev + r * H if prev != NULL else NULL,
                              &hs[r0 + r, 0])
                else:
                    for j in range(H):
                        v = g[r0 + r, j]
                        if cell == CELL_RNN_TANH:
                            v = lamina_fast_tanhf(v)
                        elif v < 0:
                            v = 0.0
                        hs[r0 + r, j] = v


def sum_squares(real[::1] x):
    """sum(x * x), accumulated in double."""
    cdef Py_ssize_t i, n = x.shape[0]
    cdef double s = 0
    for i in prange(n, nogil=True, schedule="static", use_threads_if=n > PARALLEL_MIN):
        s += <double>x[i] * x[i]
    return s


# ---------------------------------------------------------------- costs (one value per row)

cdef inline double _weight(real[::1] w, bint weighted, Py_ssize_t i) noexcept nogil:
    return w[i] if weighted else 1.0


def softmax_cross_entropy(real[:, ::1] x, const int[::1] labels, real[::1] w, bint weighted,
                          real[:, ::1] probs, real[::1] cost):
    """probs = softmax(x) row-wise (probs None: not wanted, never computed); cost[i] = -w[i] *
    log probs[i, labels[i]], computed as w[i] * (logsumexp(x[i]) - x[i, labels[i]]) (finite where
    the probability underflows; labels checked by the caller to lie in [0, classes))."""
    cdef Py_ssize_t i, rows = x.shape[0], cols = x.shape[1]
    cdef double lse
    cdef bint keep = probs is not None
    if keep and (probs.shape[0] != rows or probs.shape[1] != cols):
        raise ValueError(f"softmax_cross_entropy: probs must be {rows} x {cols}, found {probs.shape[0]} x {probs.shape[1]}")
    if cols == 0:
        return
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        lse = _softmax_row(&x[i, 0], &probs[i, 0] if keep else NULL, cols, False)
        cost[i] = <real>(_weight(w, weighted, i) * (lse - x[i, labels[i]]))


def softmax_cross_entropy_backward(real[:, ::1] probs, const int[::1] labels, real[::1] w, bint weighted,
                                   real[::1] dcost, real[:, ::1] dx, double beta):
    """dx[i] = dcost[i] * w[i] * (probs[i] - onehot(labels[i])) + beta * dx[i]."""
    cdef Py_ssize_t i, j, rows = probs.shape[0], cols = probs.shape[1]
    cdef double g
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        g = dcost[i] * _weight(w, weighted, i)
        for j in range(cols):
            if beta == 0:
                dx[i, j] = <real>(g * probs[i, j])
            else:
                dx[i, j] = <real>(g * probs[i, j] + beta * dx[i, j])
        dx[i, labels[i]] = <real>(dx[i, labels[i]] - g)


def square_error(real[:, ::1] x, real[:, ::1] t, real[::1] w, bint weighted, real[::1] cost):
    """cost[i] = w[i] * sum_j (x[i, j] - t[i, j])^2."""
    cdef Py_ssize_t i, j, rows = x.shape[0], cols = x.shape[1]
    cdef double s, d
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        s = 0
        for j in range(cols):
            d = <double>x[i, j] - t[i, j]
            s = s + d * d
        cost[i] = <real>(_weight(w, weighted, i) * s)


def square_error_backward(real[:, ::1] x, real[:, ::1] t, real[::1] w, bint weighted,
                          real[::1] dcost, real[:, ::1] dout, bint wrt_target, double beta):
    """dout = ±2 dcost[i] w[i] (x - t) + beta * dout (minus: the gradient of the target)."""
    cdef Py_ssize_t i, j, rows = x.shape[0], cols = x.shape[1]
    cdef double g, d
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        g = (-2.0 if wrt_target else 2.0) * dcost[i] * _weight(w, weighted, i)
        for j in range(cols):
            d = g * (<double>x[i, j] - t[i, j])
            if beta == 0:
                dout[i, j] = <real>d
            else:
                dout[i, j] = <real>(d + beta * dout[i, j])


# ---------------------------------------------------------------- optimizer updates (fused)
# Each rule's element-wise update is one C function per span (optimizers.h); the spans, or the
# rows of a sparse gradient, are shared by lamina's team.

cdef extern from "optimizers.h" nogil:
    ctypedef struct lamina_update_rule:
        int rule, nesterov, decoupled
        long step
        double lr, momentum, dampening, beta1, beta2, eps, alpha, weight_decay
    int LAMINA_SGD, LAMINA_ADAM, LAMINA_ADAGRAD, LAMINA_RMSPROP
    void update_span_f(const lamina_update_rule* u, float* p, const float* g, float* s1, float* s2, long n)
    void update_span_d(const lamina_update_rule* u, double* p, const double* g, double* s1, double* s2, long n)


# element-wise updates run over spans of this many values per thread
cdef enum:
    UPDATE_SPAN = 16384


ctypedef struct _update_job:
    lamina_update_rule rule
    bint single
    char* p                        # the arrays' first values; s1 / s2 NULL where the rule has none
    const char* g
    char* s1
    char* s2
    const int* rows                # the rows to update (NULL: every value, by spans)
    long n, width, itemsize        # values (or rows, and their width)


cdef inline void _update_at(_update_job* j, long offset, long n) noexcept nogil:
    cdef long b = offset * j.itemsize
    cdef char* s1 = j.s1 + b if j.s1 != NULL else NULL
    cdef char* s2 = j.s2 + b if j.s2 != NULL else NULL
    if j.single:
        update_span_f(&j.rule, <float*>(j.p + b), <const float*>(j.g + b), <float*>s1, <float*>s2, n)
    else:
        update_span_d(&j.rule, <double*>(j.p + b), <const double*>(j.g + b), <double*>s1, <double*>s2, n)


cdef void _update_items(void* args, int t, long i0, long i1) noexcept nogil:
    """Spans (or rows) i0 .. i1 of an update."""
    cdef _update_job* j = <_update_job*>args
    cdef long i
    for i in range(i0, i1):
        if j.rows != NULL:
            _update_at(j, <long>j.rows[i] * j.width, j.width)
        else:
            _update_at(j, i * UPDATE_SPAN, min(<long>UPDATE_SPAN, j.n - i * UPDATE_SPAN))


cdef inline char* _values(real[::1] a):
    """Where a's values start (NULL: none)."""
    return <char*>&a[0] if a.shape[0] else NULL


cdef inline char* _row_values(real[:, ::1] a):
    """Where a 2-D C-contiguous array's values start (NULL: none)."""
    return <char*>&a[0, 0] if a.shape[0] * a.shape[1] else NULL


cdef void _run_update(_update_job* j, bint single, size_t itemsize, char* p, const char* g, char* s1, char* s2,
                      long n, const int[::1] rows, long width):
    """The update over the n values from p (the same offsets in g, s1, s2), or over the listed
    rows of `width` values, on the team."""
    cdef long items, worth
    j.single, j.itemsize, j.width, j.n = single, itemsize, width, n
    j.p, j.g, j.s1, j.s2 = p, g, s1, s2
    j.rows = &rows[0] if rows is not None and rows.shape[0] else NULL
    if rows is not None:
        items, worth = rows.shape[0], rows.shape[0] * width
    else:
        items, worth = (n + UPDATE_SPAN - 1) // UPDATE_SPAN, n
    if items == 0 or n == 0:
        return
    with nogil:
        lamina_team_for(_threads_for(worth > PARALLEL_MIN), items, _update_items, <void*>j)


def sgd_update(real[::1] p, real[::1] g, real[::1] v, double lr, double momentum,
               double dampening, bint nesterov, double weight_decay):
    """PyTorch's SGD: g' = g + wd p; v = momentum v + (1 - dampening) g'; step = g' + momentum v
    (Nesterov) or v; p -= lr step. With momentum == 0, v is not touched."""
    cdef _update_job j
    j.rule.rule, j.rule.lr, j.rule.momentum, j.rule.dampening = LAMINA_SGD, lr, momentum, dampening
    j.rule.nesterov, j.rule.weight_decay = nesterov, weight_decay
    _run_update(&j, real is float, sizeof(real), _values(p), _values(g), _values(v) if momentum != 0 else NULL, NULL,
                p.shape[0], None, 0)


def sgd_update_rows(real[:, ::1] p, real[:, ::1] g, real[:, ::1] v, const int[::1] rows, double lr,
                    double momentum, double dampening, bint nesterov):
    """sgd_update on the listed rows only (momentum == 0: exact on a sparse gradient; with
    momentum, the lazy form: rows without gradient keep their velocity and do not move)."""
    cdef _update_job j
    j.rule.rule, j.rule.lr, j.rule.momentum, j.rule.dampening = LAMINA_SGD, lr, momentum, dampening
    j.rule.nesterov, j.rule.weight_decay = nesterov, 0.0
    _run_update(&j, real is float, sizeof(real), _row_values(p), _row_values(g),
                _row_values(v) if momentum != 0 else NULL, NULL, p.shape[0] * p.shape[1], rows, p.shape[1])


cdef void _adam_rule(lamina_update_rule* u, double lr, double beta1, double beta2, double eps,
                     double weight_decay, bint decoupled, long step):
    u.rule, u.lr, u.beta1, u.beta2, u.eps = LAMINA_ADAM, lr, beta1, beta2, eps
    u.weight_decay, u.decoupled, u.step = weight_decay, decoupled, step


def adam_update(real[::1] p, real[::1] g, real[::1] m, real[::1] v, double lr, double beta1,
                double beta2, double eps, double weight_decay, bint decoupled, long step):
    """Adam (decoupled=False: L2 added to the gradient) and AdamW (decoupled=True:
    p *= 1 - lr wd), with bias correction at `step` (1-based), as in PyTorch."""
    cdef _update_job j
    _adam_rule(&j.rule, lr, beta1, beta2, eps, weight_decay, decoupled, step)
    _run_update(&j, real is float, sizeof(real), _values(p), _values(g), _values(m), _values(v), p.shape[0], None, 0)


def adam_update_rows(real[:, ::1] p, real[:, ::1] g, real[:, ::1] m, real[:, ::1] v, const int[::1] rows,
                     double lr, double beta1, double beta2, double eps, long step):
    """Adam on the listed rows only, the lazy form (TensorFlow's LazyAdam, torch's SparseAdam):
    rows without gradient keep their moments and do not move; the bias correction uses the
    parameter's update count."""
    cdef _update_job j
    _adam_rule(&j.rule, lr, beta1, beta2, eps, 0.0, False, step)
    _run_update(&j, real is float, sizeof(real), _row_values(p), _row_values(g), _row_values(m), _row_values(v),
                p.shape[0] * p.shape[1], rows, p.shape[1])


def adagrad_update(real[::1] p, real[::1] g, real[::1] s, double lr, double eps, double weight_decay):
    """AdaGrad: g' = g + wd p; s += g'^2; p -= lr g' / (sqrt(s) + eps)."""
    cdef _update_job j
    j.rule.rule, j.rule.lr, j.rule.eps, j.rule.weight_decay = LAMINA_ADAGRAD, lr, eps, weight_decay
    _run_update(&j, real is float, sizeof(real), _values(p), _values(g), _values(s), NULL, p.shape[0], None, 0)


def adagrad_update_rows(real[:, ::1] p, real[:, ::1] g, real[:, ::1] s, const int[::1] rows, double lr, double eps):
    """AdaGrad on the listed rows (exact on a sparse gradient without weight decay: a zero
    gradient leaves both s and p unchanged)."""
    cdef _update_job j
    j.rule.rule, j.rule.lr, j.rule.eps, j.rule.weight_decay = LAMINA_ADAGRAD, lr, eps, 0.0
    _run_update(&j, real is float, sizeof(real), _row_values(p), _row_values(g), _row_values(s), NULL,
                p.shape[0] * p.shape[1], rows, p.shape[1])


def rmsprop_update(real[::1] p, real[::1] g, real[::1] s, real[::1] buf, double lr, double alpha,
                   double eps, double weight_decay, double momentum):
    """RMSProp as in PyTorch (not centered): s = alpha s + (1 - alpha) g'^2;
    with momentum: buf = momentum buf + g' / (sqrt(s) + eps), p -= lr buf; else p -= lr g'/(...)."""
    cdef _update_job j
    j.rule.rule, j.rule.lr, j.rule.alpha, j.rule.eps = LAMINA_RMSPROP, lr, alpha, eps
    j.rule.weight_decay, j.rule.momentum = weight_decay, momentum
    _run_update(&j, real is float, sizeof(real), _values(p), _values(g), _values(s),
                _values(buf) if momentum != 0 else NULL, p.shape[0], None, 0)


# ---------------------------------------------------------------- index checks

def index_range(const int[::1] ids):
    """(smallest, largest) of a non-empty int32 array, in one pass (lamina.backends.checks: two
    numpy reductions cost more than the kernels they guard on a lone request's small arrays)."""
    cdef Py_ssize_t i, n = ids.shape[0]
    if n == 0:
        raise ValueError("index_range: the array is empty")
    cdef int lo = ids[0], hi = ids[0], v
    with nogil:
        for i in range(1, n):
            v = ids[i]
            if v < lo:
                lo = v
            if v > hi:
                hi = v
    return lo, hi


# ---------------------------------------------------------------- sequence batch ordering

def gather_rows(real[:, ::1] src, const int[::1] index, real[:, ::1] dst, Py_ssize_t col):
    """dst[i] = src[index[i], col:col+k], k = dst columns (rows of a sequence batch into
    time-major order; col picks a block of columns, e.g. one direction of a bidirectional layer)."""
    cdef Py_ssize_t i, j, rows = dst.shape[0], cols = dst.shape[1]
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        for j in range(cols):
            dst[i, j] = src[index[i], col + j]


def scatter_rows(real[:, ::1] src, const int[::1] index, real[:, ::1] dst, Py_ssize_t col, double beta):
    """dst[index[i], col:col+k] = src[i] + beta * dst[index[i], col:col+k]; index must not
    repeat (a permutation or part of one), so rows never collide."""
    cdef Py_ssize_t i, j, rows = src.shape[0], cols = src.shape[1]
    for i in prange(rows, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        if beta == 0:
            for j in range(cols):
                dst[index[i], col + j] = src[i, j]
        else:
            for j in range(cols):
                dst[index[i], col + j] = <real>(src[i, j] + beta * dst[index[i], col + j])


# ---------------------------------------------------------------- recurrent cells, one step
# Gates are PyTorch's: LSTM i, f, g, o; GRU r, z, n. g holds one row per running sequence.

cdef inline double _dsig(double s) noexcept nogil:
    return s * (1 - s)


# The cells themselves are plain C (cells.h), one row at a time; these loops spread the rows of a
# step over the threads. A missing previous state is passed as NULL.

cdef inline real* _row(real[:, ::1] a, Py_ssize_t b, bint present) noexcept nogil:
    return &a[b, 0] if present else NULL


def lstm_step(real[:, ::1] g, real[:, ::1] c_prev, bint has_prev, real[:, ::1] c, real[:, ::1] h):
    """g [B, 4H] pre-activations in, activated i, f, g, o out (kept for backward);
    c = f c_prev + i g; h = o tanh(c). Without has_prev, c_prev is zero."""
    cdef Py_ssize_t b, rows = g.shape[0], H = h.shape[1]
    for b in prange(rows, nogil=True, schedule="static", use_threads_if=rows * H >= CELL_PARALLEL_MIN):
        if real is float:
            lstm_row_f(H, H, &g[b, 0], NULL, _row(c_prev, b, has_prev), &c[b, 0], &h[b, 0])
        else:
            lstm_row_d(H, H, &g[b, 0], NULL, _row(c_prev, b, has_prev), &c[b, 0], &h[b, 0])


def lstm_step_backward(real[:, ::1] g, real[:, ::1] c_prev, bint has_prev, real[:, ::1] c,
                       real[:, ::1] dh, real[:, ::1] dc, real[:, ::1] dg,
                       real[:, ::1] dc_prev, bint want_dc_prev):
    """From dh (and the cell gradient dc carried from the next step) to dg [B, 4H], the
    gradient of the gate pre-activations; dc_prev += dc_total * f (when wanted)."""
    cdef Py_ssize_t b, rows = g.shape[0], H = dh.shape[1]
    for b in prange(rows, nogil=True, schedule="static", use_threads_if=rows * H >= CELL_PARALLEL_MIN):
        if real is float:
            lstm_row_backward_f(H, H, &g[b, 0], _row(c_prev, b, has_prev), &c[b, 0], &dh[b, 0], &dc[b, 0],
                                &dg[b, 0], _row(dc_prev, b, want_dc_prev))
        else:
            lstm_row_backward_d(H, H, &g[b, 0], _row(c_prev, b, has_prev), &c[b, 0], &dh[b, 0], &dc[b, 0],
                                &dg[b, 0], _row(dc_prev, b, want_dc_prev))


def gru_step(real[:, ::1] g, real[:, ::1] hh, real[:, ::1] h_prev, bint has_prev, real[:, ::1] h):
    """g [B, 3H] = x W_ihᵀ + b_ih in, activated r, z, n out; hh [B, 3H] = h_prev W_hhᵀ + b_hh.
    r = σ(g_r + hh_r), z = σ(g_z + hh_z), n = tanh(g_n + r hh_n), h = (1 - z) n + z h_prev
    (PyTorch's GRU: the reset gate multiplies the recurrent product, bias included)."""
    cdef Py_ssize_t b, rows = g.shape[0], H = h.shape[1]
    for b in prange(rows, nogil=True, schedule="static", use_threads_if=rows * H >= CELL_PARALLEL_MIN):
        if real is float:
            gru_row_f(H, H, &g[b, 0], NULL, &hh[b, 0], _row(h_prev, b, has_prev), &h[b, 0])
        else:
            gru_row_d(H, H, &g[b, 0], NULL, &hh[b, 0], _row(h_prev, b, has_prev), &h[b, 0])


def gru_step_backward(real[:, ::1] g, real[:, ::1] hh, real[:, ::1] h_prev, bint has_prev,
                      real[:, ::1] dh, real[:, ::1] dgx, real[:, ::1] dgh,
                      real[:, ::1] dh_prev, bint want_dh_prev):
    """dgx: gradient of g (input part), dgh: of hh (recurrent part, before W_hh);
    dh_prev += dh z (the direct path; the product through W_hh is added by the caller)."""
    cdef Py_ssize_t b, rows = g.shape[0], H = dh.shape[1]
    for b in prange(rows, nogil=True, schedule="static", use_threads_if=rows * H >= CELL_PARALLEL_MIN):
        if real is float:
            gru_row_backward_f(H, H, &g[b, 0], &hh[b, 0], _row(h_prev, b, has_prev), &dh[b, 0],
                               &dgx[b, 0], &dgh[b, 0], _row(dh_prev, b, want_dh_prev))
        else:
            gru_row_backward_d(H, H, &g[b, 0], &hh[b, 0], _row(h_prev, b, has_prev), &dh[b, 0],
                               &dgx[b, 0], &dgh[b, 0], _row(dh_prev, b, want_dh_prev))


# ---------------------------------------------------------------- panel-packed GEMM (panels.h)
# Products with a weight packed once per version: the recurrent step's, and at inference a
# Linear's.

def panel_tile_rows():
    """The rows of a's tile in panel_gemm (PANEL_MR: 8 in the AVX-512 build, else 6): products
    over whole tiles of rows sum each row the same way whatever the blocks of rows."""
    return PANEL_MR


def panel_size(real[:, ::1] b, bint trans):
    """How many values the panels of op(b) take."""
    cdef long k = b.shape[1] if trans else b.shape[0]
    cdef long n = b.shape[0] if trans else b.shape[1]
    if real is float:
        return panel_count_f(n) * k * 16
    return panel_count_d(n) * k * 8


def panel_pack(real[:, ::1] b, bint trans, double alpha, real[::1] out):
    """out = the panels of alpha·op(b) (op(b) is k x n); out holds panel_size(b, trans) values."""
    cdef long k = b.shape[1] if trans else b.shape[0]
    cdef long n = b.shape[0] if trans else b.shape[1]
    cdef long ldb = b.shape[1], panels, t, nt = openmp.omp_get_max_threads(), chunk
    panels = panel_count_f(n) if real is float else panel_count_d(n)
    chunk = (panels + nt - 1) // nt
    for t in prange(nt, nogil=True, schedule="static", use_threads_if=k * n > PARALLEL_MIN):
        if real is float:
            panel_pack_f(&b[0, 0], ldb, trans, k, n, <float>alpha, min(panels, t * chunk),
                         min(panels, (t + 1) * chunk), &out[0])
        else:
            panel_pack_d(&b[0, 0], ldb, trans, k, n, alpha, min(panels, t * chunk),
                         min(panels, (t + 1) * chunk), &out[0])


def panel_gemm(real[:, ::1] a, real[::1] packed, long n, real[:, ::1] c, double beta, long p0=0, long p1=-1,
               int threads=1, bint by_rows=False, real[::1] bias=None):
    """c = a @ P + beta * c, P (a.shape[1] x n) packed by panel_pack; only the columns of panels
    p0 .. p1 (p1 -1: the last), the rest of c untouched. On a team of `threads` (team.h), each
    member taking a share of the panels, or with by_rows a block of whole row tiles. With a
    bias (n values), c = bias + a @ P in those columns (beta unused)."""
    cdef long m = a.shape[0], k = a.shape[1], panels, width = 64 // sizeof(real)  # (a panel row: 64 bytes)
    cdef long lda = a.strides[0] // sizeof(real), ldc = c.strides[0] // sizeof(real)
    panels = panel_count_f(n) if real is float else panel_count_d(n)
    p1 = panels if p1 == -1 else p1
    if k < 1 or n < 1 or packed.shape[0] != panels * k * width:
        raise ValueError(f"panel_gemm: panels of a {k} x {n} matrix take {panels * k * width} values, "
                         f"found {packed.shape[0]}")
    if c.shape[0] != m or c.shape[1] != n:
        raise ValueError(f"panel_gemm: c must be {m} x {n}, found {c.shape[0]} x {c.shape[1]}")
    if not 0 <= p0 <= p1 <= panels:
        raise ValueError(f"panel_gemm: panels {p0} .. {p1} out of 0 .. {panels}")
    if threads < 1:
        raise ValueError(f"panel_gemm: threads must be at least 1, found {threads}")
    if bias is not None and bias.shape[0] != n:
        raise ValueError(f"panel_gemm: bias must hold {n} values (one per column), found {bias.shape[0]}")
    if m == 0 or p0 == p1:
        return
    cdef real* b = &bias[0] if bias is not None else NULL
    with nogil:
        if real is float:
            panel_gemm_team_f(m, k, n, &a[0, 0], lda, &packed[0], p0, p1, &c[0, 0], ldc, <float>beta, b, threads,
                              by_rows)
        else:
            panel_gemm_team_d(m, k, n, &a[0, 0], lda, &packed[0], p0, p1, &c[0, 0], ldc, beta, b, threads, by_rows)


cdef long _row_stride(str where, str name, const real[:, :] a) except -1:
    """The distance between a's rows in values, its values along a row adjacent (a block of columns
    of a C-ordered matrix, or the matrix)."""
    cdef Py_ssize_t size = sizeof(real)
    if a.shape[1] > 1 and a.strides[1] != size or a.shape[0] > 1 and a.strides[0] < a.shape[1] * size:
        raise ValueError(f"{where}: {name} must have its values along each row adjacent and its rows apart by at "
                         f"least a row (a block of a matrix's columns), found strides {a.strides[0]}, {a.strides[1]}")
    return a.strides[0] // size if a.shape[0] > 1 else a.shape[1]


cdef int _pointwise_args(str where, long cout, long S, real[:, :] y, bias, int act, int threads) except -1:
    if y.shape[0] != cout or y.shape[1] != S or cout < 1 or S < 1:
        raise ValueError(f"{where}: y must be ({cout}, {S}) (output channels, positions), found ({y.shape[0]}, "
                         f"{y.shape[1]}); every size at least 1")
    if bias is not None and bias.shape[0] != cout:
        raise ValueError(f"{where}: bias must hold {cout} values (one per output channel), found {bias.shape[0]}")
    if act not in (0, 1, 2) or threads < 1:
        raise ValueError(f"{where}: act must be 0, 1 or 2 and threads at least 1, found {act} and {threads}")
    return 0


def pointwise_conv(const real[:, ::1] w, const real[:, :] x, real[:, :] y, real[::1] bias=None, int act=0,
                   double cap=0.0, int threads=1):
    """y = act(w @ x + bias[:, None]) for one sample of a pointwise convolution: w [cout, cin], x
    [cin, S] (S at least one panel: 64 bytes of values), y [cout, S], bias (cout values) or None; act 0 none, 1
    ReLU, 2 ReLU capped at cap. x and y may be blocks of columns of larger matrices (a block of a
    column matrix and its columns of the output). On a team of up to `threads`, sharing the
    positions (panels.h pointwise_conv)."""
    cdef long cout = w.shape[0], cin = w.shape[1], S = x.shape[1]
    if x.shape[0] != cin or cin < 1:
        raise ValueError(f"pointwise_conv: w ({cout}, {cin}) x ({x.shape[0]}, {S}): x must have w's {cin} rows "
                         f"(input channels), at least 1")
    _pointwise_args("pointwise_conv", cout, S, y, bias, act, threads)
    if S < 64 // sizeof(real):
        raise ValueError(f"pointwise_conv: at least {64 // sizeof(real)} positions (a panel), found {S}")
    cdef long ldx = _row_stride("pointwise_conv", "x", x), ldy = _row_stride("pointwise_conv", "y", y)
    cdef real* b = &bias[0] if bias is not None else NULL
    with nogil:
        if real is float:
            pointwise_conv_team_f(cout, cin, S, &w[0, 0], &x[0, 0], ldx, &y[0, 0], ldy, b, act, <float>cap, threads)
        else:
            pointwise_conv_team_d(cout, cin, S, &w[0, 0], &x[0, 0], ldx, &y[0, 0], ldy, b, act, cap, threads)


def pointwise_positions(const real[::1] packed, const real[:, :] x, real[:, :] y, real[::1] bias=None, int act=0,
                        double cap=0.0, int threads=1):
    """y = act(w @ x + bias[:, None]) for one sample of a pointwise convolution, by tiles of
    positions: packed holds the panels of w transposed (panel_pack(w, True, 1.0, packed), w
    [cout, cin]), x [cin, S], y [cout, S] (any S >= 1; blocks of columns allowed, as
    pointwise_conv's), bias (cout values) or None; act as pointwise_conv's. On a team of up to
    `threads`, sharing the output channels' panels (or the positions, where the panels are few)
    (panels.h pointwise_positions)."""
    cdef long cin = x.shape[0], S = x.shape[1], cout = y.shape[0]
    cdef long panels = panel_count_f(cout) if real is float else panel_count_d(cout)
    cdef long need = panels * cin * (64 // sizeof(real))
    _pointwise_args("pointwise_positions", cout, S, y, bias, act, threads)
    if cin < 1 or packed.shape[0] != need:
        raise ValueError(f"pointwise_positions: packed must hold the panels of a ({cout}, {cin}) weight "
                         f"transposed, {need} values, found {packed.shape[0]}")
    cdef long ldx = _row_stride("pointwise_positions", "x", x), ldy = _row_stride("pointwise_positions", "y", y)
    cdef real* b = &bias[0] if bias is not None else NULL
    with nogil:
        if real is float:
            pointwise_positions_team_f(cout, cin, S, &packed[0], &x[0, 0], ldx, &y[0, 0], ldy, b, act, <float>cap,
                                       threads)
        else:
            pointwise_positions_team_d(cout, cin, S, &packed[0], &x[0, 0], ldx, &y[0, 0], ldy, b, act, cap, threads)


# ---------------------------------------------------------------- lamina's int8 product (int8_panels.h)
INT8_LEVELS = INT8_ACTIVATION_LEVELS  # an activation row's steps in int8_product


def int8_pack_size(long k, long n):
    """Bytes of the int8 panels of a weight of n output channels, each k deep."""
    if k < 1 or n < 1:
        raise ValueError(f"int8_pack_size: a weight must have at least one channel and depth, found {n} x {k}")
    return lamina_int8_pack_size(k, n)


def int8_row_bytes(long k):
    """Bytes of an activation row of depth k in int8_product's u8 scratch (whole quads)."""
    return 4 * lamina_int8_quads(k)


def int8_pack(const signed char[:, ::1] q, signed char[::1] out):
    """out = the int8 panels of q (n output channels x k, int8_panels.h)."""
    cdef long n = q.shape[0], k = q.shape[1]
    if out.shape[0] != int8_pack_size(k, n):
        raise ValueError(f"int8_pack: the panels of a {n} x {k} weight take {lamina_int8_pack_size(k, n)} bytes, "
                         f"found {out.shape[0]}")
    with nogil:
        lamina_int8_pack(&q[0, 0], k, n, 0, lamina_int8_panels(n), &out[0])


def amx_enable():
    """Turns on the AMX tiles for the int8 and bfloat16 panel products, where this module (the
    AVX-512 one, on Linux), the CPU (AMX-TILE, AMX-BF16, AMX-INT8) and the OS allow: True if on.
    Once on they stay on: the panels' depth is padded to whole tiles, so it must be called before
    the first pack (lamina.backends.cpu.compiled calls it when it chooses the path 'amx')."""
    return bool(lamina_amx_enable())


def amx_runs():
    """Whether the int8 and bfloat16 panel products run on AMX tiles in this process."""
    return bool(lamina_amx_on)


def int8_uses_avx2():
    """Whether int8_product runs its AVX2 kernel on this CPU, or its AVX-512 VNNI one (else its
    portable one)."""
    return bool(lamina_int8_uses_avx2())


def int8_uses_vnni():
    """Whether int8_product runs its AVX-512 VNNI kernel on this CPU (the AVX-512 module, on a CPU
    with AVX512-VNNI and AVX512-VL)."""
    return bool(lamina_int8_uses_vnni())


# the deepest product whose int32 sums stay exact: a sum and its zero point's share are each at most
# k · 127 · 127 in magnitude, their difference twice that
INT8_MAX_DEPTH = (2**31 - 1) // (2 * 127 * INT8_ACTIVATION_LEVELS)


def int8_product(const float[:, ::1] a, const signed char[::1] packed, const float[::1] col_scales,
                 const int[::1] col_sums, float[:, ::1] c, float beta, const float[::1] bias,
                 unsigned char[:, ::1] u, float[::1] row_scales, int[::1] zeros, int threads=1, bint by_rows=False):
    """c = each row of a quantized to u8 (INT8_LEVELS steps, its scale and zero point in row_scales
    and zeros) times the int8 panels (int8_pack) of a weight of c.shape[1] channels, back in
    float32 with the channels' scales and integer sums, plus bias (or beta c). u: a's rows as u8
    in whole quads (a.shape[1] rounded up to 4 columns). On a team of `threads`, sharing the
    panels or (by_rows) blocks of rows."""
    cdef long m = a.shape[0], k = a.shape[1], n = c.shape[1]
    cdef lamina_int8_out out
    if k < 1 or n < 1 or packed.shape[0] != lamina_int8_pack_size(k, n):
        raise ValueError(f"int8_product: the panels of a {n} x {k} weight take "
                         f"{lamina_int8_pack_size(k, n) if k > 0 and n > 0 else 0} bytes, found {packed.shape[0]}")
    if k > INT8_MAX_DEPTH:
        raise ValueError(f"int8_product: a depth of at most {INT8_MAX_DEPTH} keeps the int32 sums exact, found {k}")
    if c.shape[0] != m or col_scales.shape[0] != n or col_sums.shape[0] != n or (bias is not None and bias.shape[0] != n):
        raise ValueError(f"int8_product: for a ({m}, {k}) times {n} channels: c ({c.shape[0]}, {n}), col_scales "
                         f"{col_scales.shape[0]}, col_sums {col_sums.shape[0]}, bias "
                         f"{None if bias is None else bias.shape[0]}")
    if u.shape[0] < m or u.shape[1] != 4 * lamina_int8_quads(k) or row_scales.shape[0] < m or zeros.shape[0] < m:
        raise ValueError(f"int8_product: scratch for {m} rows of {4 * lamina_int8_quads(k)} bytes: u ({u.shape[0]}, "
                         f"{u.shape[1]}), row_scales {row_scales.shape[0]}, zeros {zeros.shape[0]}")
    if threads < 1:
        raise ValueError(f"int8_product: threads must be at least 1, found {threads}")
    if m == 0:
        return
    out.row_scale, out.zero, out.col_scale, out.col_sum = &row_scales[0], &zeros[0], &col_scales[0], &col_sums[0]
    out.bias = &bias[0] if bias is not None else NULL
    out.beta, out.c, out.ldc = beta, &c[0, 0], c.strides[0] // sizeof(float)
    with nogil:
        lamina_int8_product_team(m, k, n, &a[0, 0], a.strides[0] // sizeof(float), &u[0, 0], u.shape[1], &packed[0],
                                 out, threads, by_rows)


# ---------------------------------------------------------------- lamina's bfloat16 product (bf16_panels.h)
def bf16_kernel_runs():
    """Whether bf16_product has a kernel for this CPU: the AVX-512 module on a CPU with
    AVX512-BF16 (elsewhere the caller multiplies the rounded operands in float32)."""
    return bool(lamina_bf16_kernel_runs())


def bf16_pack_size(long k, long n):
    """16-bit values in the bfloat16 panels of a k x n op(B)."""
    if k < 1 or n < 1:
        raise ValueError(f"bf16_pack_size: a weight must have at least one channel and depth, found {n} x {k}")
    return lamina_bf16_pack_size(k, n)


def bf16_row_values(long k):
    """16-bit values of an activation row of depth k in bf16_product's scratch (whole pairs)."""
    return 2 * lamina_bf16_pairs(k)


def bf16_pack(const float[:, ::1] b, bint trans, unsigned short[::1] out, int threads=1):
    """out = the bfloat16 panels of op(b) (trans: b is n output channels x k; else k x n;
    bf16_panels.h), its values rounded to the nearest bfloat16; on a team of `threads`."""
    cdef long k = b.shape[1] if trans else b.shape[0], n = b.shape[0] if trans else b.shape[1]
    if out.shape[0] != bf16_pack_size(k, n):
        raise ValueError(f"bf16_pack: the panels of a {k} x {n} op(b) take {lamina_bf16_pack_size(k, n)} values, "
                         f"found {out.shape[0]}")
    if threads < 1:
        raise ValueError(f"bf16_pack: threads must be at least 1, found {threads}")
    with nogil:
        lamina_bf16_pack_team(&b[0, 0], k, n, trans, &out[0], threads)


def bf16_product(const float[:, :] a, const unsigned short[::1] packed, float alpha, float[:, :] c, float beta,
                 const float[::1] bias, unsigned short[:, ::1] u, int threads=1, bint by_rows=False,
                 bint trans_a=False, bint trans_c=False, int act=0, float cap=0.0):
    """c = act(alpha · (op(a)'s rows rounded to bfloat16) times the bfloat16 panels (bf16_pack)
    of a k x n op(B), summed in float32, plus bias (or beta c)). op(a) = a, or with trans_a aᵀ
    (its rows read from a's columns: no transposed copy); c is m x n, or with trans_c n x m (the
    product's transpose: a convolution's output [channels, positions]); act 0 none, 1 ReLU, 2
    ReLU capped at cap. a and c may be blocks of columns of larger matrices (rows apart by a
    stride). u: op(a)'s rows in bfloat16, whole pairs (bf16_row_values(k) columns). On a team of
    `threads`, sharing the panels or (by_rows) blocks of rows. Only where bf16_kernel_runs()."""
    cdef long m = a.shape[1] if trans_a else a.shape[0], k = a.shape[0] if trans_a else a.shape[1]
    cdef long n = c.shape[0] if trans_c else c.shape[1]
    cdef lamina_bf16_out out
    if not lamina_bf16_kernel_runs():
        raise RuntimeError("bf16_product: this module has no bfloat16 kernel for this CPU (it needs the AVX-512 "
                           "module and AVX512-BF16); multiply the rounded operands in float32")
    if k < 1 or n < 1 or packed.shape[0] != lamina_bf16_pack_size(k, n):
        raise ValueError(f"bf16_product: the panels of a {k} x {n} op(B) take "
                         f"{lamina_bf16_pack_size(k, n) if k > 0 and n > 0 else 0} values, found {packed.shape[0]}")
    if (c.shape[1] if trans_c else c.shape[0]) != m or (bias is not None and bias.shape[0] != n):
        raise ValueError(f"bf16_product: for an op(a) of ({m}, {k}) times {n} channels: c ({c.shape[0]}, "
                         f"{c.shape[1]}) must be {(n, m) if trans_c else (m, n)}, bias "
                         f"{None if bias is None else bias.shape[0]} must be {n}")
    if u.shape[0] < m or u.shape[1] != 2 * lamina_bf16_pairs(k):
        raise ValueError(f"bf16_product: scratch for {m} rows of {2 * lamina_bf16_pairs(k)} values: u ({u.shape[0]}, "
                         f"{u.shape[1]})")
    if threads < 1:
        raise ValueError(f"bf16_product: threads must be at least 1, found {threads}")
    if act not in (0, 1, 2):
        raise ValueError(f"bf16_product: act must be 0 (none), 1 (ReLU) or 2 (capped ReLU), found {act}")
    cdef long lda = _row_stride("bf16_product", "a", a), ldc = _row_stride("bf16_product", "c", c)
    if m == 0:
        return
    out.alpha, out.beta, out.bias = alpha, beta, &bias[0] if bias is not None else NULL
    out.c, out.ldc, out.transposed, out.act, out.cap = &c[0, 0], ldc, trans_c, act, cap
    with nogil:
        lamina_bf16_product_team(m, k, n, &a[0, 0], lda, trans_a, &u[0, 0], u.shape[1], &packed[0], out, threads,
                                 by_rows)


# ---------------------------------------------------------------- a BLAS product shared by the team
# OpenBLAS runs on one thread (lamina.threads says why); a product worth two threads is split into
# blocks of c, one BLAS call each, called by the team's members (the provider's function found by
# its address: _openblas.gemm_functions), so a split costs a team's start (a microsecond or two
# while its workers watch) rather than a wake of Python workers (30-95 µs).

ctypedef void (*_sgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, float alpha, const float* a,
                           int lda, const float* b, int ldb, float beta, float* c, int ldc) noexcept nogil
ctypedef void (*_dgemm_fn)(int order, int trans_a, int trans_b, int m, int n, int k, double alpha, const double* a,
                           int lda, const double* b, int ldb, double beta, double* c, int ldc) noexcept nogil

cdef enum:  # (CBLAS's values)
    CBLAS_ROW_MAJOR = 101
    CBLAS_NO_TRANS = 111
    CBLAS_TRANS = 112

ctypedef struct _gemm_job:
    bint single, trans_a, trans_b, by_rows
    void* fn
    const void* a
    const void* b
    void* c
    const void* bias
    long m, n, k, lda, ldb, ldc, pieces, align
    double alpha, beta


cdef inline long _block_start(long size, long pieces, long align, long i) noexcept nogil:
    """Where block i of `pieces` nearly equal blocks of range(size) starts (inner bounds rounded
    to multiples of align; i = pieces: size)."""
    if i >= pieces:
        return size
    return (2 * i * size + pieces * align) // (2 * pieces * align) * align


cdef inline void _gemm_block(const _gemm_job* j, const real* a, const real* b, real* c, const real* bias,
                             long i) noexcept nogil:
    """Block i of c (rows or columns): its bias rows, then its product (beta 1), or its product
    with beta."""
    cdef long size = j.m if j.by_rows else j.n
    cdef long lo = _block_start(size, j.pieces, j.align, i), hi = _block_start(size, j.pieces, j.align, i + 1)
    cdef long rows = hi - lo if j.by_rows else j.m, cols = j.n if j.by_rows else hi - lo, r
    cdef double beta = j.beta
    if rows <= 0 or cols <= 0:
        return
    if j.by_rows:
        a, c = a + (lo if j.trans_a else lo * j.lda), c + lo * j.ldc
    else:
        b, c = b + (lo * j.ldb if j.trans_b else lo), c + lo
        if bias != NULL:
            bias = bias + lo
    if bias != NULL:
        for r in range(rows):
            memcpy(c + r * j.ldc, bias, cols * sizeof(real))
        beta = 1.0
    cdef int ta = CBLAS_TRANS if j.trans_a else CBLAS_NO_TRANS, tb = CBLAS_TRANS if j.trans_b else CBLAS_NO_TRANS
    if real is float:
        (<_sgemm_fn>j.fn)(CBLAS_ROW_MAJOR, ta, tb, <int>rows, <int>cols, <int>j.k, <float>j.alpha, a, <int>j.lda, b,
                          <int>j.ldb, <float>beta, c, <int>j.ldc)
    else:
        (<_dgemm_fn>j.fn)(CBLAS_ROW_MAJOR, ta, tb, <int>rows, <int>cols, <int>j.k, j.alpha, a, <int>j.lda, b,
                          <int>j.ldb, beta, c, <int>j.ldc)


cdef void _gemm_blocks(void* args, int t, long i0, long i1) noexcept nogil:
    cdef _gemm_job* j = <_gemm_job*>args
    cdef long i
    for i in range(i0, i1):
        if j.single:
            _gemm_block(j, <const float*>j.a, <const float*>j.b, <float*>j.c, <const float*>j.bias, i)
        else:
            _gemm_block(j, <const double*>j.a, <const double*>j.b, <double*>j.c, <const double*>j.bias, i)


def gemm_team(uintptr_t function, real[:, :] a, real[:, :] b, real[:, :] c, bint trans_a, bint trans_b,
              double alpha, double beta, bias, int pieces, bint by_rows):
    """c = alpha op(a) op(b) + beta c, or + bias (one value per column of c; beta unused), by the
    row-major CBLAS function at `function` (sgemm for float32, dgemm for float64), c cut into
    `pieces` blocks of rows (by_rows: multiples of 8) or columns (of 16), one call each, shared by
    lamina's team (team.h). Rows must be contiguous; the caller checks the shapes and types and
    gives a product with an inner size of at least 1."""
    cdef _gemm_job j
    cdef const real[::1] bv
    if function == 0:
        raise ValueError("gemm_team: no BLAS function")
    j.m, j.n = c.shape[0], c.shape[1]
    j.k = a.shape[0] if trans_a else a.shape[1]
    if j.m == 0 or j.n == 0:
        return
    if j.k < 1:
        raise ValueError(f"gemm_team: the inner size must be at least 1, found {j.k}")
    j.single, j.trans_a, j.trans_b, j.by_rows, j.fn = real is float, trans_a, trans_b, by_rows, <void*>function
    j.align = 8 if by_rows else 16
    j.pieces = max(1, min(<long>pieces, (j.m if by_rows else j.n) // j.align))
    j.lda = max(a.strides[0] // sizeof(real), a.shape[1], 1)
    j.ldb = max(b.strides[0] // sizeof(real), b.shape[1], 1)
    j.ldc = max(c.strides[0] // sizeof(real), c.shape[1], 1)
    j.a, j.b, j.c, j.alpha, j.beta = &a[0, 0], &b[0, 0], &c[0, 0], alpha, beta
    j.bias = NULL
    if bias is not None:
        bv = bias
        if bv.shape[0] != j.n:
            raise ValueError(f"gemm_team: bias must hold {j.n} values (one per column), found {bv.shape[0]}")
        j.bias = &bv[0]
    with nogil:
        lamina_team_for(<int>j.pieces, j.pieces, _gemm_blocks, &j)


def panel_count(long n, size_t itemsize):
    """How many panels n columns take (16 floats or 8 doubles each, the last zero-padded)."""
    return panel_count_f(n) if itemsize == 4 else panel_count_d(n)


# ---------------------------------------------------------------- fused forward recurrence (recurrence.h)

def recurrence_threads(int threads, bint by_rows, long H, const long[::1] starts, size_t itemsize):
    """The team size of the fused recurrence for up to `threads` threads: at most one thread per
    sequence (by rows) or per panel of units (by units, which needs whole panels of 64 bytes:
    otherwise one thread)."""
    if by_rows:
        return max(1, min(threads, starts[1] - starts[0] if starts.shape[0] > 1 else 1))
    if H * itemsize % 64:
        return 1
    return max(1, min(threads, H * itemsize // 64))


cdef int _team_size(int threads, bint by_rows, long H, const long[::1] starts, size_t itemsize, str name) except -1:
    """The recurrence's team: `threads` at most, as many as recurrence_threads lets share this batch."""
    if threads < 1:
        raise ValueError(f"{name}: threads must be at least 1, found {threads}")
    return min(threads, recurrence_threads(threads, by_rows, H, starts, itemsize))


cdef inline real* _opt(real[:, ::1] a, bint present) noexcept nogil:
    return &a[0, 0] if present else NULL


def recurrence_forward(int kind, const long[::1] starts, real[:, ::1] g, real[:, ::1] hh, real[::1] b_hh,
                       bint has_hh_bias, real[::1] packed, real[:, ::1] hs, real[:, ::1] cs, bint has_cell,
                       real[:, ::1] init_h, bint has_init_h, real[:, ::1] init_c, bint has_init_c,
                       real[:, ::1] out, const int[::1] out_rows, long out_col, int threads, bint by_rows,
                       int reduce=0, int levels=0, real[:, :, ::1] reduced=None, panels=None):
    """Every step of one direction of a recurrent layer (kind: 0 RNN tanh, 1 RNN relu, 2 LSTM,
    3 GRU) on a team of up to `threads` threads (team.h; as many as recurrence_threads lets share
    the batch), sharing it by rows (sequences) or by blocks of hidden units: see recurrence.h.
    g arrives with the input bias added (the kernels' own bias argument stays NULL).
    Row r of hs also goes to
    out[out_rows[r], out_col:out_col + H] (out_rows: a permutation of out's rows, the layer's
    output in the sequences' order). Arguments not present are placeholders. reduce (float32
    only): the recurrent product multiplies the states rounded to bfloat16 (1) or snapped to their
    rows' u8 grids of `levels` steps (2), made in `reduced` (a step's rows x H per team member); or
    multiplied as u8 rows of `levels` (at most INT8_LEVELS) steps by W_hh's int8 panels (3): panels is
    (panels, col_scales, col_sums, scratch), the pack's int8_pack panels, scales and integer sums and
    int8_state_bytes(rows, H) bytes per team member; or rounded to bfloat16 and multiplied by W_hh's
    bfloat16 panels (4, where bf16_kernel_runs()): panels is (panels, scratch), the pack's bf16_pack
    panels and bf16_state_bytes(rows, H) bytes per team member (packed is then a placeholder)."""
    cdef long steps = starts.shape[0] - 1, H = hs.shape[1], G = g.shape[1] // hs.shape[1]
    if out_rows.shape[0] != hs.shape[0] or out.shape[0] != hs.shape[0] or not 0 <= out_col <= out.shape[1] - H:
        raise ValueError(f"recurrence_forward: out ({out.shape[0]}, {out.shape[1]}) at column {out_col} and out_rows "
                         f"{out_rows.shape[0]} do not fit states {hs.shape}")
    cdef real *out_at = &out[0, out_col] if hs.shape[0] else NULL
    cdef int *rows_at = &out_rows[0] if hs.shape[0] else NULL
    cdef int team = _team_size(threads, by_rows, H, starts, sizeof(real), "recurrence_forward")
    cdef lamina_reduction reduction
    if reduce == 3:
        reduction = _int8_reduction(levels, panels, team, H, G, starts, real is float)
    elif reduce == 4:
        reduction = _bf16_reduction("recurrence_forward", panels, team, H, G * H, starts, real is float)
    else:
        reduction = _reduction("recurrence_forward", reduce, levels, reduced, team, H, starts, real is float)
    with nogil:
        if real is float:
            recurrence_forward_team_f(kind, steps, &starts[0], H, G, &g[0, 0], NULL,
                                 _opt(hh, kind == 3),
                                 &b_hh[0] if has_hh_bias else NULL, &packed[0], &hs[0, 0], _opt(cs, has_cell),
                                 _opt(init_h, has_init_h), _opt(init_c, has_init_c), out_at, out.shape[1],
                                 rows_at, team, by_rows, reduction)
        else:
            recurrence_forward_team_d(kind, steps, &starts[0], H, G, &g[0, 0], NULL,
                                 _opt(hh, kind == 3),
                                 &b_hh[0] if has_hh_bias else NULL, &packed[0], &hs[0, 0], _opt(cs, has_cell),
                                 _opt(init_h, has_init_h), _opt(init_c, has_init_c), out_at, out.shape[1],
                                 rows_at, team, by_rows, reduction)


cdef lamina_reduction _reduction(str where, int reduce, int levels, real[:, :, ::1] reduced, int team, long width,
                                 const long[::1] starts, bint single):
    """The recurrence's reduction of its product's left operand (rows of `width` values), its
    scratch checked to hold a step's rows (the first step's are the most) for each of the team's
    members."""
    cdef lamina_reduction r
    r.kind, r.levels, r.per_thread, r.scratch = reduce, levels, 0, NULL
    r.panels, r.col_scale, r.col_sum, r.rows, r.ldu = NULL, NULL, NULL, 0, 0
    if reduce == 0:
        return r
    most = starts[1] - starts[0] if starts.shape[0] > 1 else 0
    if reduce not in (1, 2) or not single or (reduce == 2 and not 1 <= levels <= 255):
        raise ValueError(f"{where}: reduce must be 1 (bfloat16) or 2 (int8, levels 1..255) in "
                         f"float32, found {reduce} with levels {levels} in {'float32' if single else 'float64'}")
    if reduced is None or reduced.shape[0] < team or reduced.shape[1] < most or reduced.shape[2] != width:
        found = None if reduced is None else tuple(reduced.shape)[:3]
        raise ValueError(f"{where}: the reduced operand needs at least ({team}, {most}, {width}), found {found}")
    r.per_thread = reduced.shape[1] * width
    r.scratch = &reduced[0, 0, 0] if reduced.shape[1] else NULL
    if r.scratch == NULL:
        r.kind = 0  # (no rows: nothing to multiply)
    return r


def int8_state_bytes(long rows, long H):
    """Scratch bytes a team member of the int8 recurrence takes: rows u8 states of H, their scales
    and zero points."""
    return rows * (4 * lamina_int8_quads(H) + 8)


cdef lamina_reduction _int8_reduction(int levels, tuple int8, int team, long H, long G, const long[::1] starts,
                                      bint single):
    """The int8 recurrence's products (recurrence.h LAMINA_REDUCE_INT8_PANELS), its arguments checked."""
    cdef lamina_reduction r
    cdef const signed char[::1] panels
    cdef const float[::1] col_scales
    cdef const int[::1] col_sums
    cdef unsigned char[::1] scratch
    most = starts[1] - starts[0] if starts.shape[0] > 1 else 0
    if not single or int8 is None or len(int8) != 4 or not 1 <= levels <= INT8_ACTIVATION_LEVELS:
        raise ValueError(f"recurrence_forward: int8 products (reduce 3) take float32, levels 1..{INT8_ACTIVATION_LEVELS} "
                         f"and (panels, col_scales, col_sums, scratch); found {'float32' if single else 'float64'}, "
                         f"levels {levels}, {None if int8 is None else len(int8)} arguments")
    panels, col_scales, col_sums, scratch = int8
    if H > INT8_MAX_DEPTH or panels.shape[0] != lamina_int8_pack_size(H, G * H) or col_scales.shape[0] != G * H \
            or col_sums.shape[0] != G * H or scratch.shape[0] < team * int8_state_bytes(most, H):
        raise ValueError(f"recurrence_forward: int8 panels of W_hh ({G * H} x {H}) take "
                         f"{lamina_int8_pack_size(H, G * H)} bytes and {G * H} scales and sums, with "
                         f"{team * int8_state_bytes(most, H)} bytes of scratch; found {panels.shape[0]}, "
                         f"{col_scales.shape[0]}, {col_sums.shape[0]}, {scratch.shape[0]}")
    r.kind, r.levels, r.per_thread = 3, levels, int8_state_bytes(most, H)
    r.scratch = &scratch[0] if scratch.shape[0] else NULL
    r.panels, r.col_scale, r.col_sum = &panels[0], &col_scales[0], &col_sums[0]
    r.rows, r.ldu = most, 4 * lamina_int8_quads(H)
    if r.scratch == NULL:
        r.kind = 0  # (no rows: nothing to multiply)
    return r


def bf16_state_bytes(long rows, long H):
    """Scratch bytes a team member of the bfloat16 recurrence takes: rows states of H in bfloat16."""
    return rows * 4 * lamina_bf16_pairs(H)


cdef lamina_reduction _bf16_reduction(str where, tuple given, int team, long k, long n, const long[::1] starts,
                                      bint single):
    """The bfloat16 recurrence's products (recurrence.h LAMINA_REDUCE_BF16_PANELS) of a step's rows
    k wide by the panels of a k x n op(W_hh), its arguments checked."""
    cdef lamina_reduction r
    cdef const unsigned short[::1] panels
    cdef unsigned char[::1] scratch
    most = starts[1] - starts[0] if starts.shape[0] > 1 else 0
    if not single or given is None or len(given) != 2 or not lamina_bf16_kernel_runs():
        raise ValueError(f"{where}: bfloat16 products (reduce 4) take float32, (panels, scratch) and a "
                         f"module with a bfloat16 kernel for this CPU; found {'float32' if single else 'float64'}, "
                         f"{None if given is None else len(given)} arguments, kernel "
                         f"{'present' if lamina_bf16_kernel_runs() else 'absent'}")
    panels, scratch = given
    if panels.shape[0] != lamina_bf16_pack_size(k, n) or scratch.shape[0] < team * bf16_state_bytes(most, k):
        raise ValueError(f"{where}: bfloat16 panels of a {k} x {n} op(W_hh) take "
                         f"{lamina_bf16_pack_size(k, n)} values, with {team * bf16_state_bytes(most, k)} bytes "
                         f"of scratch; found {panels.shape[0]}, {scratch.shape[0]}")
    r.kind, r.levels, r.per_thread = 4, 0, bf16_state_bytes(most, k)
    r.scratch = &scratch[0] if scratch.shape[0] else NULL
    r.panels, r.col_scale, r.col_sum = &panels[0], NULL, NULL
    r.rows, r.ldu = most, 4 * lamina_bf16_pairs(k)
    if r.scratch == NULL:
        r.kind = 0  # (no rows: nothing to multiply)
    return r


def recurrence_backward(int kind, const long[::1] starts, real[:, ::1] g, real[:, ::1] hh, real[:, ::1] hs,
                        real[:, ::1] cs, real[:, ::1] dhs, real[:, ::1] dcs, bint has_cell, real[:, ::1] dg,
                        real[:, ::1] dgh, real[::1] packed, real[:, ::1] init_h, bint has_init_h,
                        real[:, ::1] init_c, bint has_init_c, real[:, ::1] dh0, bint want_dh0,
                        real[:, ::1] dc0, bint want_dc0, int threads, bint by_rows, int reduce=0,
                        real[:, :, ::1] reduced=None, panels=None):
    """Every step of one direction's backward recurrence, on a team as in recurrence_forward;
    packed: the panels of W_hh itself (G·H x H). Arguments not present are placeholders. reduce 1
    (float32 only): the product dG · W_hh multiplies dG's rows rounded to bfloat16, made in
    `reduced` (a step's rows x G·H per team member); reduce 4 (where bf16_kernel_runs()): the
    same rounded rows times W_hh's bfloat16 panels, panels = (bf16_pack panels of W_hh, not
    transposed; bf16_state_bytes(rows, G·H) bytes per team member), packed a placeholder."""
    cdef long steps = starts.shape[0] - 1, H = hs.shape[1], G = g.shape[1] // hs.shape[1]
    cdef int team = _team_size(threads, by_rows, H, starts, sizeof(real), "recurrence_backward")
    cdef lamina_reduction reduction
    if reduce == 4:
        reduction = _bf16_reduction("recurrence_backward", panels, team, G * H, H, starts, real is float)
    else:
        reduction = _reduction("recurrence_backward", reduce, 0, reduced, team, G * H, starts, real is float)
    with nogil:
        if real is float:
            recurrence_backward_team_f(kind, steps, &starts[0], H, G, &g[0, 0], _opt(hh, kind == 3), &hs[0, 0],
                                  _opt(cs, has_cell), &dhs[0, 0], _opt(dcs, has_cell), &dg[0, 0], &dgh[0, 0],
                                  &packed[0], _opt(init_h, has_init_h), _opt(init_c, has_init_c),
                                  _opt(dh0, want_dh0), _opt(dc0, want_dc0), team, by_rows, reduction)
        else:
            recurrence_backward_team_d(kind, steps, &starts[0], H, G, &g[0, 0], _opt(hh, kind == 3), &hs[0, 0],
                                  _opt(cs, has_cell), &dhs[0, 0], _opt(dcs, has_cell), &dg[0, 0], &dgh[0, 0],
                                  &packed[0], _opt(init_h, has_init_h), _opt(init_c, has_init_c),
                                  _opt(dh0, want_dh0), _opt(dc0, want_dc0), team, by_rows, reduction)


# ---------------------------------------------------------------- embeddings and sparse rows

def scatter_add_rows(real[:, ::1] src, const int[::1] ids, real[:, ::1] dst):
    """dst[ids[i]] += src[i]; ids may repeat (each thread owns a block of columns, so repeated
    rows never race)."""
    cdef Py_ssize_t i, j, j0, j1, c, rows = src.shape[0], cols = src.shape[1]
    cdef Py_ssize_t nchunks = (cols + BIAS_CHUNK - 1) // BIAS_CHUNK
    for c in prange(nchunks, nogil=True, schedule="static", use_threads_if=rows * cols > PARALLEL_MIN):
        j0 = c * BIAS_CHUNK
        j1 = min(j0 + BIAS_CHUNK, cols)
        for i in range(rows):
            for j in range(j0, j1):
                dst[ids[i], j] += src[i, j]


def fill_rows(real[:, ::1] dst, const int[::1] rows, double value):
    """dst[rows] = value."""
    cdef Py_ssize_t i, j, n = rows.shape[0], cols = dst.shape[1]
    for i in prange(n, nogil=True, schedule="static", use_threads_if=n * cols > PARALLEL_MIN):
        for j in range(cols):
            dst[rows[i], j] = <real>value


# ---------------------------------------------------------------- sequence pooling and softmax

cdef enum:
    POOL_LAST = 0
    POOL_FIRST = 1
    POOL_AVERAGE = 2
    POOL_SUM = 3
    POOL_MAX = 4


def sequence_pool(int mode, real[:, ::1] x, const int[::1] starts, real[:, ::1] out, int[:, ::1] argmax):
    """One row per sequence: its last, first, average, sum or max (argmax keeps the winning row
    for backward) over the sequence's rows."""
    cdef Py_ssize_t s, t, j, n = out.shape[0], cols = out.shape[1]
    cdef Py_ssize_t a, b
    cdef double acc
    for s in prange(n, nogil=True, schedule="static", use_threads_if=x.shape[0] * cols > PARALLEL_MIN):
        a = starts[s]
        b = starts[s + 1]
        for j in range(cols):
            if mode == POOL_LAST:
                out[s, j] = x[b - 1, j]
            elif mode == POOL_FIRST:
                out[s, j] = x[a, j]
            elif mode == POOL_MAX:
                argmax[s, j] = <int>a
                for t in range(a + 1, b):
                    if x[t, j] > x[argmax[s, j], j]:
                        argmax[s, j] = <int>t
                out[s, j] = x[argmax[s, j], j]
            else:
                acc = 0
                for t in range(a, b):
                    acc = acc + x[t, j]
                out[s, j] = <real>(acc / (b - a) if mode == POOL_AVERAGE else acc)


def sequence_pool_backward(int mode, real[:, ::1] dy, const int[::1] starts, int[:, ::1] argmax,
                           real[:, ::1] dx, double beta):
    """dx = d pooled / d x applied to dy (with beta)."""
    cdef Py_ssize_t s, t, j, n = dy.shape[0], cols = dy.shape[1]
    cdef Py_ssize_t a, b
    cdef double v
    for s in prange(n, nogil=True, schedule="static", use_threads_if=dx.shape[0] * cols > PARALLEL_MIN):
        a = starts[s]
        b = starts[s + 1]
        for t in range(a, b):
            for j in range(cols):
                if mode == POOL_LAST:
                    v = dy[s, j] if t == b - 1 else 0.0
                elif mode == POOL_FIRST:
                    v = dy[s, j] if t == a else 0.0
                elif mode == POOL_MAX:
                    v = dy[s, j] if t == argmax[s, j] else 0.0
                elif mode == POOL_AVERAGE:
                    v = dy[s, j] / (b - a)
                else:
                    v = dy[s, j]
                if beta == 0:
                    dx[t, j] = <real>v
                else:
                    dx[t, j] = <real>(v + beta * dx[t, j])


def sequence_softmax(real[::1] x, const int[::1] starts, real[::1] y):
    """y = softmax of x over each sequence's steps (one value per step)."""
    cdef Py_ssize_t s, t, n = starts.shape[0] - 1
    cdef double mx, total
    for s in prange(n, nogil=True, schedule="static", use_threads_if=x.shape[0] > PARALLEL_MIN):
        mx = x[starts[s]]
        for t in range(starts[s] + 1, starts[s + 1]):
            if x[t] > mx:
                mx = x[t]
        total = 0
        for t in range(starts[s], starts[s + 1]):
            y[t] = <real>exp(x[t] - mx)
            total = total + y[t]
        for t in range(starts[s], starts[s + 1]):
            y[t] = <real>(y[t] / total)


def sequence_softmax_backward(real[::1] y, real[::1] dy, const int[::1] starts, real[::1] dx, double beta):
    """dx = y (dy - Σ_seq dy y) per sequence (with beta)."""
    cdef Py_ssize_t s, t, n = starts.shape[0] - 1
    cdef double d
    for s in prange(n, nogil=True, schedule="static", use_threads_if=y.shape[0] > PARALLEL_MIN):
        d = 0
        for t in range(starts[s], starts[s + 1]):
            d = d + dy[t] * y[t]
        for t in range(starts[s], starts[s + 1]):
            if beta == 0:
                dx[t] = <real>(y[t] * (dy[t] - d))
            else:
                dx[t] = <real>(y[t] * (dy[t] - d) + beta * dx[t])


# ---------------------------------------------------------------- attention and layer normalization

cdef extern from "attention.h" nogil:
    long attention_scratch(long n, long d)
    long attention_backward_scratch(long n, long d)
    void attention_head_f(const float* qkv, long E, long d, long h, long heads, long a, long b, float scale,
                          int causal, float* out, float* lse, float* kt)
    void attention_head_d(const double* qkv, long E, long d, long h, long heads, long a, long b, double scale,
                          int causal, double* out, double* lse, double* kt)
    void attention_head_backward_f(const float* qkv, const float* out, const float* lse, const float* dout, long E,
                                   long d, long h, long heads, long a, long b, float scale, int causal,
                                   float* dqkv, float* kt)
    void attention_head_backward_d(const double* qkv, const double* out, const double* lse, const double* dout,
                                   long E, long d, long h, long heads, long a, long b, double scale, int causal,
                                   double* dqkv, double* kt)


def attention_scratch_size(long longest, long d, bint backward):
    """Values of scratch per thread for sequences of up to `longest` rows and heads of d, the
    forward's or backward's (attention.h)."""
    return attention_backward_scratch(longest, d) if backward else attention_scratch(longest, d)


def _check_scratch(scratch, long longest, long d, bint backward):
    if scratch.shape[1] < attention_scratch_size(longest, d, backward):
        raise ValueError(f"attention scratch of {scratch.shape[1]} values per thread, needs "
                         f"{attention_scratch_size(longest, d, backward)}")


cdef long _longest(const int[::1] starts) noexcept nogil:
    cdef long s, best = 0
    for s in range(starts.shape[0] - 1):
        best = max(best, starts[s + 1] - starts[s])
    return best


def attention(const real[:, ::1] qkv, const int[::1] starts, int heads, double scale, bint causal,
              real[:, ::1] out, real[:, ::1] lse, real[:, ::1] scratch):
    """out and lse of attention within each sequence (attention.h); scratch [threads,
    attention_scratch_size(...)] holds each thread's transposed keys and running outputs."""
    _check_scratch(scratch, _longest(starts), out.shape[1] // heads, False)
    _attention_tasks(False, &qkv[0, 0], &out[0, 0], &lse[0, 0], NULL, NULL, starts, out.shape[1], heads, scale,
                     causal, scratch)


def attention_backward(const real[:, ::1] qkv, real[:, ::1] out, real[:, ::1] lse,
                       const real[:, ::1] dout, const int[::1] starts, int heads, double scale, bint causal,
                       real[:, ::1] dqkv, real[:, ::1] scratch):
    """dqkv (written, not added) of attention within each sequence (attention.h); scratch
    [threads, attention_scratch_size(...)] holds each thread's transposed keys and values."""
    _check_scratch(scratch, _longest(starts), out.shape[1] // heads, True)
    _attention_tasks(True, &qkv[0, 0], &out[0, 0], &lse[0, 0], &dout[0, 0], &dqkv[0, 0], starts, out.shape[1], heads,
                     scale, causal, scratch)


ctypedef struct _attention_job:
    bint backward, causal, single   # single: float32 arrays (else float64)
    const void* qkv
    const void* out
    void* lse
    const void* dout
    void* dqkv
    const int* starts
    long n, E, heads, stride        # stride: each thread's scratch, values
    double scale
    void* scratch


cdef void _attention_run(void* args, int t, long p0, long p1) noexcept nogil:
    """The tasks p0 .. p1 of _attention_tasks, in thread t's scratch."""
    cdef _attention_job* j = <_attention_job*>args
    cdef long p, s, h, a, b, d = j.E // j.heads
    for p in range(p0, p1):
        s, h = p % j.n, p // j.n  # neighbouring tasks take other sequences: no rows shared
        a, b = j.starts[s], j.starts[s + 1]
        if b <= a:
            continue
        if j.single:
            if j.backward:
                attention_head_backward_f(<const float*>j.qkv, <const float*>j.out, <const float*>j.lse,
                                          <const float*>j.dout, j.E, d, h, j.heads, a, b, <float>j.scale, j.causal,
                                          <float*>j.dqkv, <float*>j.scratch + t * j.stride)
            else:
                attention_head_f(<const float*>j.qkv, j.E, d, h, j.heads, a, b, <float>j.scale, j.causal,
                                 <float*>j.out, <float*>j.lse, <float*>j.scratch + t * j.stride)
        else:
            if j.backward:
                attention_head_backward_d(<const double*>j.qkv, <const double*>j.out, <const double*>j.lse,
                                          <const double*>j.dout, j.E, d, h, j.heads, a, b, j.scale, j.causal,
                                          <double*>j.dqkv, <double*>j.scratch + t * j.stride)
            else:
                attention_head_d(<const double*>j.qkv, j.E, d, h, j.heads, a, b, j.scale, j.causal,
                                 <double*>j.out, <double*>j.lse, <double*>j.scratch + t * j.stride)


cdef void _attention_tasks(bint backward, const real* qkv, real* out, real* lse, const real* dout, real* dqkv,
                           const int[::1] starts, long E, long heads, double scale, bint causal,
                           real[:, ::1] scratch) noexcept nogil:
    """One task per (sequence, head) on lamina's team (team.h), forward (out and lse written) or
    backward (dqkv written from out, lse and dout); at most one thread per row of scratch."""
    cdef _attention_job j
    j.backward, j.causal, j.single = backward, causal, real is float
    j.qkv, j.out, j.lse, j.dout, j.dqkv = qkv, out, lse, dout, dqkv
    j.starts, j.n, j.E, j.heads, j.scale = &starts[0], starts.shape[0] - 1, E, heads, scale
    j.stride, j.scratch = scratch.shape[1], &scratch[0, 0]
    cdef int threads = min(<long>scratch.shape[0], _threads_for(_attention_work(starts, E) > PARALLEL_MIN))
    lamina_team_for(threads, j.n * heads, _attention_run, &j)


cdef long _attention_work(const int[::1] starts, long E) noexcept nogil:
    """Σ length² E: the multiply-adds of a batch's attention."""
    cdef long total = 0, s, t
    for s in range(starts.shape[0] - 1):
        t = starts[s + 1] - starts[s]
        total += t * t * E
    return total


cdef extern from "norms.h" nogil:
    enum: NORM_CHUNK
    void layer_norm_row_f(const float* x, long n, double eps, int center, const float* gamma, const float* beta,
                          float* y, float* mean, float* rstd)
    void layer_norm_row_d(const double* x, long n, double eps, int center, const double* gamma,
                          const double* beta, double* y, double* mean, double* rstd)
    void layer_norm_row_backward_f(const float* x, const float* dy, long n, float mean, float rstd, int center,
                                   const float* gamma, float* dx, double beta)
    void layer_norm_row_backward_d(const double* x, const double* dy, long n, double mean, double rstd, int center,
                                   const double* gamma, double* dx, double beta)
    void layer_norm_param_grads_f(const float* x, const float* dy, const float* mean, const float* rstd, long rows,
                                  long n, long j0, long j1, float* dgamma, double gamma_beta, float* dbeta,
                                  double beta_beta)
    void layer_norm_param_grads_d(const double* x, const double* dy, const double* mean, const double* rstd,
                                  long rows, long n, long j0, long j1, double* dgamma, double gamma_beta,
                                  double* dbeta, double beta_beta)


ctypedef struct _norm_job:
    bint single, center             # single: float32 arrays (else float64)
    const void* x
    const void* dy
    const void* gamma
    const void* beta
    void* y
    void* mean
    void* rstd
    void* dx
    void* dgamma
    void* dbeta
    long rows, n
    double eps, dx_beta, dgamma_beta, dbeta_beta


cdef void _layer_norm_rows(void* args, int t, long r0, long r1) noexcept nogil:
    cdef _norm_job* j = <_norm_job*>args
    cdef long i, n = j.n
    for i in range(r0, r1):
        if j.single:
            layer_norm_row_f(<const float*>j.x + i * n, n, j.eps, j.center, <const float*>j.gamma,
                             <const float*>j.beta, <float*>j.y + i * n, <float*>j.mean + i, <float*>j.rstd + i)
        else:
            layer_norm_row_d(<const double*>j.x + i * n, n, j.eps, j.center, <const double*>j.gamma,
                             <const double*>j.beta, <double*>j.y + i * n, <double*>j.mean + i, <double*>j.rstd + i)


cdef void _layer_norm_grad_rows(void* args, int t, long r0, long r1) noexcept nogil:
    cdef _norm_job* j = <_norm_job*>args
    cdef long i, n = j.n
    for i in range(r0, r1):
        if j.single:
            layer_norm_row_backward_f(<const float*>j.x + i * n, <const float*>j.dy + i * n, n,
                                      (<const float*>j.mean)[i], (<const float*>j.rstd)[i], j.center,
                                      <const float*>j.gamma, <float*>j.dx + i * n, j.dx_beta)
        else:
            layer_norm_row_backward_d(<const double*>j.x + i * n, <const double*>j.dy + i * n, n,
                                      (<const double*>j.mean)[i], (<const double*>j.rstd)[i], j.center,
                                      <const double*>j.gamma, <double*>j.dx + i * n, j.dx_beta)


cdef void _layer_norm_param_grad_chunks(void* args, int t, long c0, long c1) noexcept nogil:
    """dgamma and dbeta over the columns of chunks c0 .. c1 of NORM_CHUNK, a chunk at a time (the
    most layer_norm_param_grads sums at once)."""
    cdef _norm_job* j = <_norm_job*>args
    cdef long c, j0, j1
    for c in range(c0, c1):
        j0, j1 = c * NORM_CHUNK, min((c + 1) * NORM_CHUNK, j.n)
        if j.single:
            layer_norm_param_grads_f(<const float*>j.x, <const float*>j.dy, <const float*>j.mean,
                                     <const float*>j.rstd, j.rows, j.n, j0, j1, <float*>j.dgamma, j.dgamma_beta,
                                     <float*>j.dbeta, j.dbeta_beta)
        else:
            layer_norm_param_grads_d(<const double*>j.x, <const double*>j.dy, <const double*>j.mean,
                                     <const double*>j.rstd, j.rows, j.n, j0, j1, <double*>j.dgamma, j.dgamma_beta,
                                     <double*>j.dbeta, j.dbeta_beta)


def layer_norm(const real[:, ::1] x, const real[::1] gamma, const real[::1] beta, double eps, bint center,
               real[:, ::1] y, real[::1] mean, real[::1] rstd):
    """Each row normalised (norms.h): y = (x - mean) rstd gamma + beta; an empty gamma or beta is
    absent (1, 0). Rows shared by lamina's team (team.h) from PARALLEL_MIN values."""
    cdef _norm_job j
    j.rows, j.n = x.shape[0], x.shape[1]
    if j.rows == 0:
        return
    j.single, j.center, j.eps = real is float, center, eps
    j.x, j.y, j.mean, j.rstd = &x[0, 0], &y[0, 0], &mean[0], &rstd[0]
    j.gamma = &gamma[0] if gamma.shape[0] else NULL
    j.beta = &beta[0] if beta.shape[0] else NULL
    with nogil:
        lamina_team_for(_threads_for(j.rows * j.n > PARALLEL_MIN), j.rows, _layer_norm_rows, &j)


def layer_norm_backward(const real[:, ::1] x, const real[:, ::1] dy, const real[::1] mean, const real[::1] rstd,
                        const real[::1] gamma, bint center, real[:, ::1] dx, double dx_beta, real[::1] dgamma,
                        double dgamma_beta, real[::1] dbeta, double dbeta_beta):
    """dx by rows, dgamma and dbeta by blocks of columns, each written with its beta, on the team
    as the forward; an empty gamma is absent (1), an empty target is not computed."""
    cdef _norm_job j
    j.rows, j.n = x.shape[0], x.shape[1]
    if j.rows == 0:
        return
    j.single, j.center = real is float, center
    j.x, j.dy, j.mean, j.rstd = &x[0, 0], &dy[0, 0], &mean[0], &rstd[0]
    j.gamma = &gamma[0] if gamma.shape[0] else NULL
    j.dx = &dx[0, 0] if dx.shape[0] else NULL
    j.dgamma = &dgamma[0] if dgamma.shape[0] else NULL
    j.dbeta = &dbeta[0] if dbeta.shape[0] else NULL
    j.dx_beta, j.dgamma_beta, j.dbeta_beta = dx_beta, dgamma_beta, dbeta_beta
    cdef int threads = _threads_for(j.rows * j.n > PARALLEL_MIN)
    with nogil:
        if j.dx != NULL:
            lamina_team_for(threads, j.rows, _layer_norm_grad_rows, &j)
        if j.dgamma != NULL or j.dbeta != NULL:
            lamina_team_for(threads, (j.n + NORM_CHUNK - 1) // NORM_CHUNK, _layer_norm_param_grad_chunks, &j)


# ---------------------------------------------------------------- volumes: vol2col / col2vol
# A volume is one sample's [C, D, H, W]; a 2-D image is the same with D = 1 and a kernel of depth 1.
# The column matrix has one row per (channel, kd, kh, kw) and one column per window position
# (od, oh, ow) of an oD x oH x oW grid: the GEMM operand of a convolution. The caller gives the
# grid (a convolution's output size; for a transposed convolution, its input size).

cdef extern from "rows.h" nogil:
    double lamina_sum_f(const float *a, long n)
    double lamina_sum_d(const double *a, long n)
    double lamina_sum_sq_dev_f(const float *a, long n, double m)
    double lamina_sum_sq_dev_d(const double *a, long n, double m)


def sum_squares_rows(real[:, ::1] x, const int[::1] rows):
    """sum(x[rows] ** 2) without gathering the rows (rows checked by the caller), in double: each
    row by the vectorised sum of squared deviations from 0."""
    cdef Py_ssize_t i, n = rows.shape[0], cols = x.shape[1]
    cdef double s = 0
    for i in prange(n, nogil=True, schedule="static", use_threads_if=n * cols > PARALLEL_MIN):
        if real is float:
            s += lamina_sum_sq_dev_f(&x[rows[i], 0], cols, 0.0)
        else:
            s += lamina_sum_sq_dev_d(&x[rows[i], 0], cols, 0.0)
    return s


cdef extern from "volumes.h" nogil:
    void vol2col_channel_f(const float* x, long D, long H, long W, float* col, long ldcol, const long* geo,
                           long oH, long oW, long r0, long r1)
    void vol2col_channel_d(const double* x, long D, long H, long W, double* col, long ldcol, const long* geo,
                           long oH, long oW, long r0, long r1)
    void col2vol_channel_f(const float* col, long ldcol, float* x, long D, long H, long W, const long* geo,
                           long oH, long oW, long r0, long r1)
    void col2vol_channel_d(const double* col, long ldcol, double* x, long D, long H, long W, const long* geo,
                           long oH, long oW, long r0, long r1)
    void depth_to_space_channel_f(const float* col, long ldcol, float* x, long sd, long sh, long sw, long oH,
                                  long oW, long r0, long r1, const float* bias, int relu)
    void depth_to_space_channel_d(const double* col, long ldcol, double* x, long sd, long sh, long sw, long oH,
                                  long oW, long r0, long r1, const double* bias, int relu)


# ---------------------------------------------------------------- depthwise convolution
# A convolution whose groups are its input channels (MobileNet's depthwise layers): output
# channel o reads input channel o // mult alone. Volumes [N, C, D, H, W] (2-D: D = 1), weights
# [C·mult, kd·kh·kw]; one task per (sample, channel) plane, so no two tasks write one value.

cdef extern from "depthwise.h" nogil:
    long lamina_dw_rows(long oH, long kh, long sh, long dh)
    long lamina_dw_width(long oW, long kw, long sw, long dw)
    long lamina_dw_phase_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw)
    long lamina_dw_outputs_size(long oH, long oW, long kw, long sw, long dw)
    long lamina_dw_scratch_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw)
    void lamina_dw_stage_f(const float* x, long H, long W, long sh, long sw, long ph, long pw, long rows, long width,
                           long phase, float* q)
    void lamina_dw_stage_d(const double* x, long H, long W, long sh, long sw, long ph, long pw, long rows, long width,
                           long phase, double* q)
    void lamina_dw_taps_f(const float* q, long phase, long width, const float* w, long kh, long kw, long sh, long sw,
                          long dh, long dw, long count, float* acc)
    void lamina_dw_taps_d(const double* q, long phase, long width, const double* w, long kh, long kw, long sh,
                          long sw, long dh, long dw, long count, double* acc)
    long lamina_dw_channels_size(long oH, long oW, long kh, long kw, long sh, long sw, long dh, long dw)
    void lamina_dw_channels_f(const float* x, long in_plane, long lanes, long H, long W, const float* w, long kh,
                              long kw, long sh, long sw, long ph, long pw, long dh, long dw, const float* bias,
                              int clamp, float cap, float* y, long out_plane, long oH, long oW, float* stage)
    void lamina_dw_channels_d(const double* x, long in_plane, long lanes, long H, long W, const double* w, long kh,
                              long kw, long sh, long sw, long ph, long pw, long dh, long dw, const double* bias,
                              int clamp, double cap, double* y, long out_plane, long oH, long oW, double* stage)
    void lamina_dw_store_f(const float* acc, long width, long oH, long oW, int clamp, float cap, float* y)
    void lamina_dw_store_d(const double* acc, long width, long oH, long oW, int clamp, double cap, double* y)
    void lamina_dw_plane_back_f(const float* dy, long oH, long oW, const float* w, long kh, long kw, long sh,
                                long sw, long ph, long pw, long dh, long dw, float* dx, long H, long W)
    void lamina_dw_plane_back_d(const double* dy, long oH, long oW, const double* w, long kh, long kw, long sh,
                                long sw, long ph, long pw, long dh, long dw, double* dx, long H, long W)
    void lamina_dw_plane_taps_f(const float* x, long H, long W, const float* dy, long oH, long oW, long kh, long kw,
                                long sh, long sw, long ph, long pw, long dh, long dw, double* sums)
    void lamina_dw_plane_taps_d(const double* x, long H, long W, const double* dy, long oH, long oW, long kh,
                                long kw, long sh, long sw, long ph, long pw, long dh, long dw, double* sums)


cdef _check_depthwise(str where, Py_ssize_t n_x, Py_ssize_t C, Py_ssize_t n_y, Py_ssize_t O, Py_ssize_t w_rows,
                      Py_ssize_t w_cols, int kd, int kh, int kw, int sd, int sh, int sw, int dd, int dh, int dw):
    """Raise unless the sizes fit: reads of the inputs are bounded by the planes' own sizes in the
    kernels; the weights, channels and windows are checked here."""
    if min(kd, kh, kw, sd, sh, sw, dd, dh, dw) < 1:
        raise ValueError(f"{where}: kernel, strides and dilation must be at least 1, found {(kd, kh, kw)}, "
                         f"{(sd, sh, sw)}, {(dd, dh, dw)}")
    if C < 1 or O % C:
        raise ValueError(f"{where}: {O} output channels for {C} input channels (a whole multiple of them expected)")
    if w_rows != O or w_cols != kd * kh * kw:
        raise ValueError(f"{where}: the weights must be [{O}, {kd * kh * kw}], found [{w_rows}, {w_cols}]")
    if n_x != n_y:
        raise ValueError(f"{where}: {n_x} input samples for {n_y} output samples")


def depthwise_scratch_size(int oH, int oW, int kh, int kw, int sh, int sw, int dh, int dw):
    """The values of one thread's scratch for depthwise_conv (depthwise.h), either form."""
    return max(lamina_dw_scratch_size(oH, oW, kh, kw, sh, sw, dh, dw),
               lamina_dw_channels_size(oH, oW, kh, kw, sh, sw, dh, dw))


ctypedef struct _depthwise_job:
    bint single, clamp, by_channels  # single: float32 arrays (else float64)
    const void* x                  # [N, C, D, H, W]
    const void* w                  # [O, K]
    const void* bias               # [O] or NULL
    void* y                        # [N, O, oD, oH, oW]
    void* scratch
    long stride                    # each thread's scratch, values
    long C, D, H, W, O, oD, oH, oW, mult, K, lanes, blocks
    long kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw
    long rows, width, phase, count
    double cap


cdef inline void _depthwise_planes_of(const _depthwise_job* j, const real* x, const real* w, const real* bias,
                                      real* y, real* q, long t0, long t1) noexcept nogil:
    """Planes t0 .. t1 of the (sample, channel) planes, each staged in q (depthwise.h)."""
    cdef real* acc = q + j.sh * j.sw * j.phase
    cdef long task, n, o, od, a, i_d, i
    cdef real b0
    for task in range(t0, t1):
        n, o = task // j.O, task % j.O
        b0 = bias[o] if bias != NULL else 0
        for od in range(j.oD):
            for i in range(j.count):
                acc[i] = b0
            for a in range(j.kd):
                i_d = od * j.sd - j.pd + a * j.dd
                if 0 <= i_d < j.D:
                    if real is float:
                        lamina_dw_stage_f(x + ((n * j.C + o // j.mult) * j.D + i_d) * j.H * j.W, j.H, j.W, j.sh, j.sw,
                                          j.ph, j.pw, j.rows, j.width, j.phase, q)
                        lamina_dw_taps_f(q, j.phase, j.width, w + o * j.K + a * j.kh * j.kw, j.kh, j.kw, j.sh, j.sw,
                                         j.dh, j.dw, j.count, acc)
                    else:
                        lamina_dw_stage_d(x + ((n * j.C + o // j.mult) * j.D + i_d) * j.H * j.W, j.H, j.W, j.sh, j.sw,
                                          j.ph, j.pw, j.rows, j.width, j.phase, q)
                        lamina_dw_taps_d(q, j.phase, j.width, w + o * j.K + a * j.kh * j.kw, j.kh, j.kw, j.sh, j.sw,
                                         j.dh, j.dw, j.count, acc)
            if real is float:
                lamina_dw_store_f(acc, j.width, j.oH, j.oW, j.clamp, <float>j.cap,
                                  y + ((n * j.O + o) * j.oD + od) * j.oH * j.oW)
            else:
                lamina_dw_store_d(acc, j.width, j.oH, j.oW, j.clamp, j.cap, y + ((n * j.O + o) * j.oD + od) * j.oH * j.oW)


cdef inline void _depthwise_channels_of(const _depthwise_job* j, const real* x, const real* w, const real* bias,
                                        real* y, real* q, long t0, long t1) noexcept nogil:
    """Tasks t0 .. t1 of the (sample, block of lanes channels) tasks (images: D = oD = 1)."""
    cdef long task, n, c0, count
    for task in range(t0, t1):
        n, c0 = task // j.blocks, task % j.blocks * j.lanes
        count = min(j.lanes, j.O - c0)
        if real is float:
            lamina_dw_channels_f(x + (n * j.C + c0) * j.H * j.W, j.H * j.W, count, j.H, j.W, w + c0 * j.K, j.kh, j.kw,
                                 j.sh, j.sw, j.ph, j.pw, j.dh, j.dw, bias + c0 if bias != NULL else NULL, j.clamp,
                                 <float>j.cap, y + (n * j.O + c0) * j.oH * j.oW, j.oH * j.oW, j.oH, j.oW, q)
        else:
            lamina_dw_channels_d(x + (n * j.C + c0) * j.H * j.W, j.H * j.W, count, j.H, j.W, w + c0 * j.K, j.kh, j.kw,
                                 j.sh, j.sw, j.ph, j.pw, j.dh, j.dw, bias + c0 if bias != NULL else NULL, j.clamp,
                                 j.cap, y + (n * j.O + c0) * j.oH * j.oW, j.oH * j.oW, j.oH, j.oW, q)


cdef inline void _depthwise_tasks_of(const _depthwise_job* j, const real* x, const real* w, const real* bias,
                                     real* y, real* q, long t0, long t1) noexcept nogil:
    if j.by_channels:
        _depthwise_channels_of(j, x, w, bias, y, q, t0, t1)
    else:
        _depthwise_planes_of(j, x, w, bias, y, q, t0, t1)


cdef void _depthwise_tasks(void* args, int t, long t0, long t1) noexcept nogil:
    """Tasks t0 .. t1 of depthwise_conv, in thread t's scratch."""
    cdef _depthwise_job* j = <_depthwise_job*>args
    if j.single:
        _depthwise_tasks_of(j, <const float*>j.x, <const float*>j.w, <const float*>j.bias, <float*>j.y,
                            <float*>j.scratch + t * j.stride, t0, t1)
    else:
        _depthwise_tasks_of(j, <const double*>j.x, <const double*>j.w, <const double*>j.bias, <double*>j.y,
                            <double*>j.scratch + t * j.stride, t0, t1)


def depthwise_conv(const real[:, :, :, :, ::1] x, const real[:, ::1] w, real[:, :, :, :, ::1] y, bias, bint clamp,
                   double cap, real[:, ::1] scratch, int kd, int kh, int kw, int sd, int sh, int sw, int pd, int ph,
                   int pw, int dd, int dh, int dw, bint by_channels=False):
    """y[n, o] = Σ_taps w[o, tap] x[n, o // mult] at the tap's offset (+ bias[o]; where clamp is
    set, 0 where below 0 and cap where above cap: ReLU with cap = inf, ReLU6 with 6): every
    output is written. scratch [threads, depthwise_scratch_size(...)] holds each thread's staged
    input planes and outputs (depthwise.h); the tasks are shared by lamina's team (team.h), at
    most one thread per row of scratch. by_channels: vectors along channels instead of along
    each plane (lamina_dw_channels: images, one output channel per input channel)."""
    cdef Py_ssize_t N = y.shape[0], O = y.shape[1], oD = y.shape[2], oH = y.shape[3], oW = y.shape[4]
    cdef Py_ssize_t D = x.shape[2], H = x.shape[3], W = x.shape[4], mult = O // x.shape[1]
    cdef const real[::1] bv
    _check_depthwise("depthwise_conv", x.shape[0], x.shape[1], N, O, w.shape[0], w.shape[1], kd, kh, kw, sd, sh, sw,
                     dd, dh, dw)
    if bias is not None:
        bv = bias
        if bv.shape[0] != O:
            raise ValueError(f"depthwise_conv: bias must hold {O} values, found {bv.shape[0]}")
    need = depthwise_scratch_size(oH, oW, kh, kw, sh, sw, dh, dw)
    if scratch.shape[0] < 1 or scratch.shape[1] < need:
        raise ValueError(f"depthwise_conv: scratch must be [threads, {need}], found "
                         f"[{scratch.shape[0]}, {scratch.shape[1]}]")
    if by_channels and (mult != 1 or D != 1 or oD != 1 or kd != 1):
        raise ValueError(f"depthwise_conv: by channels takes images with one output channel per input channel, "
                         f"found {O} outputs of {x.shape[1]} channels, depth {D} -> {oD}, kernel depth {kd}")
    if N * O == 0:
        return
    cdef _depthwise_job j
    j.single, j.clamp, j.cap = real is float, clamp, cap
    j.x, j.w, j.y, j.scratch, j.stride = &x[0, 0, 0, 0, 0], &w[0, 0], &y[0, 0, 0, 0, 0], &scratch[0, 0], scratch.shape[1]
    j.bias = &bv[0] if bias is not None else NULL
    j.C, j.D, j.H, j.W, j.O, j.oD, j.oH, j.oW, j.mult, j.K = x.shape[1], D, H, W, O, oD, oH, oW, mult, w.shape[1]
    j.kd, j.kh, j.kw, j.sd, j.sh, j.sw, j.pd, j.ph, j.pw, j.dd, j.dh, j.dw = kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw
    j.rows, j.width = lamina_dw_rows(oH, kh, sh, dh), lamina_dw_width(oW, kw, sw, dw)
    j.phase, j.count = lamina_dw_phase_size(oH, oW, kh, kw, sh, sw, dh, dw), lamina_dw_outputs_size(oH, oW, kw, sw, dw)
    j.lanes = 8 if real is float else 4
    j.blocks = (O + j.lanes - 1) // j.lanes
    cdef int threads = min(<long>scratch.shape[0], _threads_for(N * O * oD * oH * oW * kd * kh * kw > PARALLEL_MIN))
    j.by_channels = by_channels
    with nogil:
        lamina_team_for(threads, N * j.blocks if by_channels else N * O, _depthwise_tasks, &j)


def depthwise_conv_input_grad(const real[:, :, :, :, ::1] dy, const real[:, ::1] w, real[:, :, :, :, ::1] dx,
                              double beta, int kd, int kh, int kw, int sd, int sh, int sw, int pd, int ph, int pw,
                              int dd, int dh, int dw):
    """dx[n, c] = beta dx[n, c] + Σ over its output channels and taps of w · dy spread back to the
    inputs each output read."""
    cdef Py_ssize_t N = dx.shape[0], C = dx.shape[1], D = dx.shape[2], H = dx.shape[3], W = dx.shape[4]
    cdef Py_ssize_t oD = dy.shape[2], oH = dy.shape[3], oW = dy.shape[4], mult = dy.shape[1] // C
    cdef Py_ssize_t task, n, c, o, od, a, i_d, j, volume = D * H * W
    cdef real* target
    _check_depthwise("depthwise_conv_input_grad", N, C, dy.shape[0], dy.shape[1], w.shape[0], w.shape[1], kd, kh, kw,
                     sd, sh, sw, dd, dh, dw)
    for task in prange(N * C, nogil=True, schedule="static",
                       use_threads_if=N * dy.shape[1] * oD * oH * oW * kd * kh * kw > PARALLEL_MIN):
        n = task // C
        c = task % C
        target = &dx[n, c, 0, 0, 0]
        for j in range(volume):
            target[j] = 0 if beta == 0 else <real>(beta * target[j])
        for o in range(c * mult, (c + 1) * mult):
            for od in range(oD):
                for a in range(kd):
                    i_d = od * sd - pd + a * dd
                    if 0 <= i_d < D:
                        if real is float:
                            lamina_dw_plane_back_f(&dy[n, o, od, 0, 0], oH, oW, &w[o, a * kh * kw], kh, kw, sh, sw,
                                                   ph, pw, dh, dw, &dx[n, c, i_d, 0, 0], H, W)
                        else:
                            lamina_dw_plane_back_d(&dy[n, o, od, 0, 0], oH, oW, &w[o, a * kh * kw], kh, kw, sh, sw,
                                                   ph, pw, dh, dw, &dx[n, c, i_d, 0, 0], H, W)


def depthwise_conv_weight_grad(const real[:, :, :, :, ::1] x, const real[:, :, :, :, ::1] dy, real[:, ::1] dwt,
                               double[:, ::1] sums, double beta, int kd, int kh, int kw, int sd, int sh, int sw, int pd, int ph, int pw,
                               int dd, int dh, int dw):
    """dwt[o, tap] = beta dwt[o, tap] + Σ over samples and outputs of dy · the input the tap read,
    summed in double in sums (scratch of dwt's shape: each channel's task owns its row)."""
    cdef Py_ssize_t N = x.shape[0], D = x.shape[2], H = x.shape[3], W = x.shape[4]
    cdef Py_ssize_t O = dy.shape[1], oD = dy.shape[2], oH = dy.shape[3], oW = dy.shape[4], mult = O // x.shape[1]
    cdef Py_ssize_t o, n, od, a, i_d, t, taps = kd * kh * kw
    _check_depthwise("depthwise_conv_weight_grad", N, x.shape[1], dy.shape[0], O, dwt.shape[0], dwt.shape[1], kd, kh,
                     kw, sd, sh, sw, dd, dh, dw)
    if sums.shape[0] != O or sums.shape[1] != taps:
        raise ValueError(f"depthwise_conv_weight_grad: sums must be [{O}, {taps}], found [{sums.shape[0]}, "
                         f"{sums.shape[1]}]")
    for o in prange(O, nogil=True, schedule="static", use_threads_if=N * O * oD * oH * oW * taps > PARALLEL_MIN):
        for t in range(taps):
            sums[o, t] = 0
        for n in range(N):
            for od in range(oD):
                for a in range(kd):
                    i_d = od * sd - pd + a * dd
                    if 0 <= i_d < D:
                        if real is float:
                            lamina_dw_plane_taps_f(&x[n, o // mult, i_d, 0, 0], H, W, &dy[n, o, od, 0, 0], oH, oW,
                                                   kh, kw, sh, sw, ph, pw, dh, dw, &sums[o, a * kh * kw])
                        else:
                            lamina_dw_plane_taps_d(&x[n, o // mult, i_d, 0, 0], H, W, &dy[n, o, od, 0, 0], oH, oW,
                                                   kh, kw, sh, sw, ph, pw, dh, dw, &sums[o, a * kh * kw])
        for t in range(taps):
            dwt[o, t] = <real>sums[o, t] if beta == 0 else <real>(sums[o, t] + beta * dwt[o, t])


# resampling runs over tasks of (outer index, a span of this many inner positions)
cdef enum:
    RESAMPLE_SPAN = 256


cdef struct ResampleTask:
    Py_ssize_t outer, first, last  # inner positions [first, last)


cdef inline ResampleTask _resample_task(Py_ssize_t task, Py_ssize_t spans, Py_ssize_t inner) noexcept nogil:
    cdef ResampleTask t
    t.outer = task // spans
    t.first = (task % spans) * RESAMPLE_SPAN
    t.last = min(t.first + RESAMPLE_SPAN, inner)
    return t


def resample_axis(real[:, :, ::1] x, const int[:, ::1] taps, const real[:, ::1] weights, real[:, :, ::1] y):
    """y[o, j, i] = Σ_k weights[j, k] x[o, taps[j, k], i] (taps checked by the caller to lie in
    [0, x.shape[1]))."""
    cdef Py_ssize_t outer = y.shape[0], m = y.shape[1], inner = y.shape[2], K = taps.shape[1]
    cdef Py_ssize_t spans = (inner + RESAMPLE_SPAN - 1) // RESAMPLE_SPAN, task, j, k, i
    cdef ResampleTask t
    cdef double acc
    for task in prange(outer * spans, nogil=True, schedule="static",
                       use_threads_if=outer * m * inner * K > PARALLEL_MIN):
        t = _resample_task(task, spans, inner)
        for j in range(m):
            for i in range(t.first, t.last):
                acc = 0
                for k in range(K):
                    acc = acc + weights[j, k] * x[t.outer, taps[j, k], i]
                y[t.outer, j, i] = <real>acc


def resample_axis_backward(const real[:, :, ::1] dy, const int[:, ::1] taps, const real[:, ::1] weights,
                           real[:, :, ::1] dx, double beta):
    """dx[o, t, i] = Σ over (j, k) with taps[j, k] = t of weights[j, k] dy[o, j, i], with beta: each
    task owns its (outer index, span) of dx, so the sums need no atomics."""
    cdef Py_ssize_t outer = dx.shape[0], n = dx.shape[1], inner = dx.shape[2]
    cdef Py_ssize_t m = dy.shape[1], K = taps.shape[1]
    cdef Py_ssize_t spans = (inner + RESAMPLE_SPAN - 1) // RESAMPLE_SPAN, task, j, k, i, src
    cdef ResampleTask t
    cdef real w
    for task in prange(outer * spans, nogil=True, schedule="static",
                       use_threads_if=outer * m * inner * K > PARALLEL_MIN):
        t = _resample_task(task, spans, inner)
        for src in range(n):
            for i in range(t.first, t.last):
                dx[t.outer, src, i] = 0 if beta == 0 else <real>(beta * dx[t.outer, src, i])
        for j in range(m):
            for k in range(K):
                src = taps[j, k]
                w = weights[j, k]
                for i in range(t.first, t.last):
                    dx[t.outer, src, i] = dx[t.outer, src, i] + w * dy[t.outer, j, i]


def vol2col(real[:, :, :, ::1] x, real[:, ::1] col, int kd, int kh, int kw, int sd, int sh, int sw,
            int pd, int ph, int pw, int dd, int dh, int dw, Py_ssize_t oD, Py_ssize_t oH, Py_ssize_t oW,
            Py_ssize_t r0, Py_ssize_t r1):
    """col[(c, a, b, e), (r - r0)·oW + ow] = x[c, od*sd - pd + a*dd, oh*sh - ph + b*dh, ow*sw - pw + e*dw]
    for the window rows r = od·oH + oh in [r0, r1), zero where the window falls in the padding.
    Overwrites col. (Working on a block of rows keeps col small enough to stay in cache.) The
    channels run in parallel; each channel's rows are volumes.h's vol2col_channel."""
    cdef Py_ssize_t C = x.shape[0], D = x.shape[1], H = x.shape[2], W = x.shape[3], c
    cdef Py_ssize_t per = kd * kh * kw, ld = col.shape[1]
    cdef long geo[12]
    geo[:] = [kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw]
    for c in prange(C, nogil=True, schedule="static", use_threads_if=col.shape[0] * col.shape[1] > VOLUME_PARALLEL_MIN):
        if real is float:
            vol2col_channel_f(&x[c, 0, 0, 0], D, H, W, &col[c * per, 0], ld, geo, oH, oW, r0, r1)
        else:
            vol2col_channel_d(&x[c, 0, 0, 0], D, H, W, &col[c * per, 0], ld, geo, oH, oW, r0, r1)


def col2vol(real[:, ::1] col, real[:, :, :, ::1] x, int kd, int kh, int kw, int sd, int sh, int sw,
            int pd, int ph, int pw, int dd, int dh, int dw, Py_ssize_t oD, Py_ssize_t oH, Py_ssize_t oW,
            Py_ssize_t r0, Py_ssize_t r1):
    """The adjoint of vol2col over the same block of window rows: x[c, i_d, i_h, i_w] +=
    col[(c, a, b, e), (r - r0)·oW + ow]. ACCUMULATES into x (zero it first for a fresh result);
    channels run in parallel, and a channel's rows only touch that channel, so nothing races."""
    cdef Py_ssize_t C = x.shape[0], D = x.shape[1], H = x.shape[2], W = x.shape[3], c
    cdef Py_ssize_t per = kd * kh * kw, ld = col.shape[1]
    cdef long geo[12]
    geo[:] = [kd, kh, kw, sd, sh, sw, pd, ph, pw, dd, dh, dw]
    for c in prange(C, nogil=True, schedule="static", use_threads_if=col.shape[0] * col.shape[1] > VOLUME_PARALLEL_MIN):
        if real is float:
            col2vol_channel_f(&col[c * per, 0], ld, &x[c, 0, 0, 0], D, H, W, geo, oH, oW, r0, r1)
        else:
            col2vol_channel_d(&col[c * per, 0], ld, &x[c, 0, 0, 0], D, H, W, geo, oH, oW, r0, r1)


def depth_to_space(real[:, ::1] col, real[:, :, :, ::1] x, int sd, int sh, int sw, Py_ssize_t r0, Py_ssize_t r1,
                   real[::1] bias=None, bint relu=False):
    """x[c, od·sd + a, oh·sh + b, ow·sw + e] = col[((c·sd + a)·sh + b)·sw + e, (r - r0)·oW + ow] for
    the window rows r = od·oH + oh in [r0, r1) of x [C, oD·sd, oH·sh, oW·sw]: the placement step
    of a transposed convolution whose kernel equals its stride (no padding, no dilation), where
    every output is written once (overwrites); plus bias[c] unless bias is None, through a ReLU
    where relu is set (as the forward kernels store). Channels run in parallel."""
    cdef Py_ssize_t C = x.shape[0], c, oD, oH, oW, per = sd * sh * sw, ld = col.shape[1]
    cdef real* b = _epilogue_bias("depth_to_space", bias, relu, C, False)
    if min(sd, sh, sw) < 1 or x.shape[1] % sd or x.shape[2] % sh or x.shape[3] % sw:
        raise ValueError(f"depth_to_space: strides {(sd, sh, sw)} must be at least 1 and divide the volume "
                         f"{_dims(x)[1:]}")
    oD, oH, oW = x.shape[1] // sd, x.shape[2] // sh, x.shape[3] // sw
    if not 0 <= r0 <= r1 <= oD * oH or col.shape[0] != C * per or ld < (r1 - r0) * oW:
        raise ValueError(f"depth_to_space: window rows [{r0}, {r1}) of {oD * oH} need col [{C * per}, "
                         f">={(r1 - r0) * oW}], found {(col.shape[0], ld)}")
    for c in prange(C, nogil=True, schedule="static", use_threads_if=col.shape[0] * col.shape[1] > VOLUME_PARALLEL_MIN):
        if real is float:
            depth_to_space_channel_f(&col[c * per, 0], ld, &x[c, 0, 0, 0], sd, sh, sw, oH, oW, r0, r1,
                                     b + c if b != NULL else NULL, relu)
        else:
            depth_to_space_channel_d(&col[c * per, 0], ld, &x[c, 0, 0, 0], sd, sh, sw, oH, oW, r0, r1,
                                     b + c if b != NULL else NULL, relu)


cdef extern from "direct_conv.h" nogil:
    enum: CO_BLOCK "LAMINA_CO_BLOCK"
    enum: DW_MAX_KW "LAMINA_DW_MAX_KW"
    enum: DW_CO_BLOCK "LAMINA_DW_CO_BLOCK"
    enum: DW_WIDE_LANES "LAMINA_DW_WIDE_LANES"
    void direct_conv_dw_f(const float* xp, long cin, long Dp, long Hp, long Wp, const float* dyp, long cout,
                          long oD, long oH, long oWp, const long* geo, float* partials, float* dw)
    void direct_conv_dw_f16(const float* xp, long cin, long Dp, long Hp, long Wp, const float* dyp, long cout,
                            long oD, long oH, long oWp, const long* geo, float* partials, float* dw)
    void direct_conv_dw_d(const double* xp, long cin, long Dp, long Hp, long Wp, const double* dyp, long cout,
                          long oD, long oH, long oWp, const long* geo, double* partials, double* dw)
    void direct_pad_f(const float* src, long C, long D, long H, long W, float* dst, long Dp, long Hp, long Wp,
                      long pd, long ph, long pw)
    void direct_pad_d(const double* src, long C, long D, long H, long W, double* dst, long Dp, long Hp, long Wp,
                      long pd, long ph, long pw)
    void direct_conv_groups_f(const float* xp, long C, long Dp, long Hp, long Wp, const float* packed, long cout,
                              int groups, const long* geo, float* y, long oD, long oH, long oW, const float* bias,
                              int relu, int accumulate, int pool_depth)
    void direct_conv_groups_d(const double* xp, long C, long Dp, long Hp, long Wp, const double* packed, long cout,
                              int groups, const long* geo, double* y, long oD, long oH, long oW, const double* bias,
                              int relu, int accumulate, int pool_depth)
    ctypedef struct lamina_direct_batch:
        const void* x
        const void* packed
        const void* bias
        const long* geo
        void** xp
        void* y
        long N, x_stride, y_stride, C, D, H, W, Dp, Hp, Wp, pd, ph, pw, cout, oD, oH, oW, next
        int groups, relu, accumulate, pool_depth
    void direct_batch_member_f(void* job, int t, int nt)
    void direct_batch_member_d(void* job, int t, int nt)


cdef void _padded_copy(real[:, :, :, ::1] src, real[:, :, :, ::1] dst, Py_ssize_t pd, Py_ssize_t ph,
                       Py_ssize_t pw, Py_ssize_t phases=1) noexcept nogil:
    """dst = zeros, with src copied in at offset (pd, ph, pw) (dst big enough: _check_padded): a
    volume padded for direct_conv.h. phases = s > 1 splits each padded row by width phase, phase
    by phase: dst[r·C + c, d, h, j] = padded src[c, d, h, j·s + r]."""
    cdef Py_ssize_t c, d, h, j, w
    if phases == 1:
        if real is float:
            direct_pad_f(&src[0, 0, 0, 0], src.shape[0], src.shape[1], src.shape[2], src.shape[3], &dst[0, 0, 0, 0],
                         dst.shape[1], dst.shape[2], dst.shape[3], pd, ph, pw)
        else:
            direct_pad_d(&src[0, 0, 0, 0], src.shape[0], src.shape[1], src.shape[2], src.shape[3], &dst[0, 0, 0, 0],
                         dst.shape[1], dst.shape[2], dst.shape[3], pd, ph, pw)
        return
    memset(&dst[0, 0, 0, 0], 0, dst.shape[0] * dst.shape[1] * dst.shape[2] * dst.shape[3] * sizeof(real))
    for c in range(src.shape[0]):
        for d in range(src.shape[1]):
            for h in range(src.shape[2]):
                for j in range(src.shape[3]):
                    w = j + pw
                    dst[(w % phases) * src.shape[0] + c, d + pd, h + ph, w // phases] = src[c, d, h, j]


cdef tuple _dims(real[:, :, :, ::1] a):
    return (a.shape[0], a.shape[1], a.shape[2], a.shape[3])


cdef _check_padded(str where, tuple src, tuple dst, Py_ssize_t pd, Py_ssize_t ph, Py_ssize_t pw, Py_ssize_t phases):
    """The padded scratch holds the source at (pd, ph, pw), split into `phases` width phases."""
    cdef Py_ssize_t C = src[0], D = src[1], H = src[2], W = src[3]
    if min(pd, ph, pw) < 0 or phases < 1:
        raise ValueError(f"{where}: padding and phases must not be negative, found {(pd, ph, pw)}, {phases}")
    need = (C * phases, D + pd, H + ph, (W + pw + phases - 1) // phases)
    if dst[0] != need[0] or dst[1] < need[1] or dst[2] < need[2] or dst[3] < need[3]:
        raise ValueError(f"{where}: the padded scratch must be [{need[0]}, >={need[1]}, >={need[2]}, >={need[3]}] "
                         f"for a source {src} padded by {(pd, ph, pw)} in {phases} width phase(s), found {dst}")


cdef _check_direct(str where, Py_ssize_t cin, tuple xp, Py_ssize_t packed, tuple y, int groups, long* geo,
                   tuple origin, Py_ssize_t vector_width):
    """Every read of direct_conv.h's direct_conv stays inside xp [cin, Dp, Hp, Wp] and the
    packed weights: geo = kd, kh, kw, sd, sh, dd, dh, dw; outputs y [cout, oD, oH, oW] read the
    window from `origin` (d, h, w) on, in tiles of vector_width widths."""
    cdef Py_ssize_t cout = y[0], oD = y[1], oH = y[2], oW = y[3], k
    if groups < 1 or cin % groups or cout % groups or xp[0] != cin:
        raise ValueError(f"{where}: {cin} input and {cout} output channels in {groups} groups, the padded input "
                         f"{xp}")
    for k in range(8):
        if geo[k] < 1:
            raise ValueError(f"{where}: kernel sizes, strides and dilations must be at least 1, found "
                             f"{[geo[i] for i in range(8)]}")
    if min(origin) < 0 or min(oD, oH, oW) < 1:
        raise ValueError(f"{where}: origin {origin} and output {y} must not be negative or empty")
    last = (origin[0] + (oD - 1) * geo[3] + (geo[0] - 1) * geo[5], origin[1] + (oH - 1) * geo[4] + (geo[1] - 1) * geo[6],
            origin[2] + ((oW - 1) // vector_width + 1) * vector_width + (geo[2] - 1) * geo[7] - 1)
    if last[0] >= xp[1] or last[1] >= xp[2] or last[2] >= xp[3]:
        raise ValueError(f"{where}: the output {y[1:]} from origin {origin} reads the padded input up to {last}, "
                         f"outside its {xp[1:]}")
    in_g, out_g = cin // groups, cout // groups
    need = groups * ((out_g + CO_BLOCK - 1) // CO_BLOCK) * in_g * geo[0] * geo[1] * geo[2] * CO_BLOCK
    if packed < need:
        raise ValueError(f"{where}: the packed weights hold {packed} values, expected {need}")


def direct_conv_block():
    """Output channels per register tile of direct_conv (the weight packing's block)."""
    return CO_BLOCK


def padded_copy(real[:, :, :, ::1] x, real[:, :, :, ::1] xp, int pd, int ph, int pw, int phases=1):
    """xp = x padded by zeros for direct_conv_padded: x at (pd, ph, pw), the rest zero; with
    phases = s > 1 each padded row split by width phase, phase by phase (xp[r·C + c, d, h, j] =
    padded x[c, d, h, j·s + r]), so a convolution of stride s along the width is a sum of s
    convolutions of stride 1, one per phase."""
    _check_padded("padded_copy", _dims(x), _dims(xp), pd, ph, pw, phases)
    with nogil:
        _padded_copy(x, xp, pd, ph, pw, phases)


cdef void _direct_run(real[:, :, :, ::1] xp, real[::1] packed, real[:, :, :, ::1] y, int groups, long* geo,
                      Py_ssize_t d0, Py_ssize_t h0, Py_ssize_t w0, real* bias, bint relu,
                      bint accumulate, int pool_depth=0) noexcept nogil:
    """direct_conv.h over every group (the caller checked the sizes: _check_direct; bias, NULL or
    one per output channel: _check_epilogue); with pool_depth > 0, y is the max pool of kernel
    and stride pool_depth x 2 x 2 of the convolution (direct_conv_pooled)."""
    if real is float:
        direct_conv_groups_f(&xp[0, d0, h0, w0], xp.shape[0], xp.shape[1], xp.shape[2], xp.shape[3], &packed[0],
                             y.shape[0], groups, geo, &y[0, 0, 0, 0], y.shape[1], y.shape[2], y.shape[3], bias, relu,
                             accumulate, pool_depth)
    else:
        direct_conv_groups_d(&xp[0, d0, h0, w0], xp.shape[0], xp.shape[1], xp.shape[2], xp.shape[3], &packed[0],
                             y.shape[0], groups, geo, &y[0, 0, 0, 0], y.shape[1], y.shape[2], y.shape[3], bias, relu,
                             accumulate, pool_depth)


cdef real* _epilogue_bias(str where, real[::1] bias, bint relu, Py_ssize_t cout, bint accumulate) except? NULL:
    """The bias a forward kernel adds as it stores its output: NULL for none, else checked to hold
    one value per output channel. A bias or a ReLU is refused with accumulate (which adds the
    sums to y as it is)."""
    if accumulate and (bias is not None or relu):
        raise ValueError(f"{where}: a bias or a ReLU applies when the output is overwritten, not with accumulate")
    if bias is None:
        return NULL
    if bias.shape[0] != cout:
        raise ValueError(f"{where}: bias must hold one value per output channel ({cout}), found {bias.shape[0]}")
    return &bias[0]


def direct_conv_padded(real[:, :, :, ::1] xp, real[::1] packed, real[:, :, :, ::1] y, int groups,
                       int kd, int kh, int kw, int sd, int sh, int dd, int dh, int dw, int d0=0, int h0=0, int w0=0,
                       bint accumulate=False, real[::1] bias=None, bint relu=False):
    """y [Cout, oD, oH, oW] = the unit-width-stride convolution of an already padded volume xp
    [C, Dp, Hp, Wp] (padded_copy) by direct_conv.h, its windows starting at (d0, h0, w0): output
    (od, oh, ow) reads xp[:, d0 + od·sd + a·dd, h0 + oh·sh + b·dh, w0 + ow + e·dw]. packed: the
    weights as direct_conv.h reads them, per group. Overwrites y with the sums plus bias (None:
    none), through a ReLU where relu is set; or adds the sums to y (accumulate)."""
    cdef long geo[8]
    geo[:] = [kd, kh, kw, sd, sh, dd, dh, dw]
    _check_direct("direct_conv_padded", xp.shape[0], _dims(xp), packed.shape[0], _dims(y), groups, geo,
                  (d0, h0, w0), 16 if real is float else 8)
    cdef real* b = _epilogue_bias("direct_conv_padded", bias, relu, y.shape[0], accumulate)
    with nogil:
        _direct_run(xp, packed, y, groups, geo, d0, h0, w0, b, relu, accumulate)


cdef _team_count(str where, str name, str what, rows, int threads):
    """A batch kernel's team of `threads` (1 to LAMINA_TEAM_MAX) has one of `rows` (`what`) each."""
    if not 1 <= threads <= LAMINA_TEAM_MAX:
        raise ValueError(f"{where}: threads must be 1 to {LAMINA_TEAM_MAX}, found {threads}")
    if len(rows) < threads:
        raise ValueError(f"{where}: {name} must hold {what} for each of the {threads} threads, found {len(rows)}")


cdef _team_scratch(str where, str name, rows, int threads, Py_ssize_t need, void** out, real* kind):
    """Each of a batch kernel's `threads` members gets its own scratch: out[t] = rows[t], a writable
    contiguous array of the kernel's type (`kind` picks it) holding at least `need` values."""
    cdef real[::1] row
    cdef Py_ssize_t t
    _team_count(where, name, "a scratch array", rows, threads)
    for t in range(threads):
        try:
            row = rows[t]
        except (TypeError, ValueError) as e:
            raise ValueError(f"{where}: {name}[{t}] must be a writable contiguous 1-D array of the data's type ({e})") from None
        if row.shape[0] < need:
            raise ValueError(f"{where}: {name}[{t}] must hold at least {need} values, found {row.shape[0]}")
        out[t] = &row[0]


cdef _team_boxes(str where, rows, int threads, tuple dims, void** out, real* kind):
    """As _team_scratch, for padded copies [C, Dp, Hp, Wp] of the sizes `dims` (direct_conv's xp,
    whose count the caller checked: _team_count)."""
    cdef real[:, :, :, ::1] box
    cdef Py_ssize_t t
    for t in range(threads):
        box = rows[t]
        if _dims(box) != dims:
            raise ValueError(f"{where}: every padded copy must be {dims} like xp[0], found xp[{t}] {_dims(box)}")
        out[t] = &box[0, 0, 0, 0]


def direct_conv(real[:, :, :, :, ::1] x, real[::1] packed, real[:, :, :, :, ::1] y, xp,
                int groups, int kd, int kh, int kw, int sd, int sh, int pd, int ph, int pw, int dd, int dh, int dw,
                bint accumulate=False, real[::1] bias=None, bint relu=False, int threads=1, int pool_depth=0):
    """y[n] = (or +=, accumulate) the convolution of each sample x[n] [C, D, H, W] with unit
    stride along the width: x[n] padded into an array [C, Dp, Hp, Wp] of the sequence xp (as
    padded_copy; its width leaves a vector's worth past each row), then direct_conv_padded (bias
    and relu as there). y [N, Cout, oD, oH, oW]; one call for the samples, checked once, on a team
    of `threads` (team.h) that take runs of samples (lamina_claim_run), member t padding into
    xp[t]. With
    pool_depth 1 or 2, y [N, Cout, pD, pH, pW] is instead the max pool of kernel and stride
    pool_depth x 2 x 2 of those outputs (no padding, sizes rounded down), the outputs themselves
    never stored."""
    cdef Py_ssize_t N = x.shape[0]
    cdef long geo[8]
    geo[:] = [kd, kh, kw, sd, sh, dd, dh, dw]
    if y.shape[0] != N:
        raise ValueError(f"direct_conv: {N} input samples and {y.shape[0]} output samples")
    if pool_depth not in (0, 1, 2) or (pool_depth and accumulate):
        raise ValueError(f"direct_conv: pool_depth must be 0, 1 or 2, and 0 with accumulate; found {pool_depth}"
                         f"{' with accumulate' if accumulate else ''}")
    _team_count("direct_conv", "xp", "a padded copy", xp, threads)
    cdef real[:, :, :, ::1] first = xp[0]
    cdef void* copies[LAMINA_TEAM_MAX]
    _team_boxes("direct_conv", xp, threads, _dims(first), copies, &packed[0])
    if N == 0:
        return
    _check_padded("direct_conv", _dims(x[0]), _dims(first), pd, ph, pw, 1)
    # the outputs computed: those the pool's windows cover
    computed = _dims(y[0]) if not pool_depth else (y.shape[1], y.shape[2] * pool_depth, 2 * y.shape[3], 2 * y.shape[4])
    _check_direct("direct_conv", first.shape[0], _dims(first), packed.shape[0], computed, groups, geo, (0, 0, 0),
                  16 if real is float else 8)
    cdef real* b = _epilogue_bias("direct_conv", bias, relu, y.shape[1], accumulate)
    cdef lamina_direct_batch job
    job.x, job.packed, job.bias, job.geo, job.xp, job.y = &x[0, 0, 0, 0, 0], &packed[0], b, geo, copies, &y[0, 0, 0, 0, 0]
    job.N, job.x_stride, job.y_stride = N, x.strides[0] // sizeof(real), y.strides[0] // sizeof(real)
    job.C, job.D, job.H, job.W = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
    job.Dp, job.Hp, job.Wp = first.shape[1], first.shape[2], first.shape[3]
    job.pd, job.ph, job.pw = pd, ph, pw
    job.cout, job.oD, job.oH, job.oW = y.shape[1], y.shape[2], y.shape[3], y.shape[4]
    job.next, job.groups, job.relu, job.accumulate, job.pool_depth = 0, groups, relu, accumulate, pool_depth
    with nogil:
        lamina_team_run(threads, direct_batch_member_f if real is float else direct_batch_member_d, &job)


cdef extern from "winograd.h" nogil:
    long lamina_wino_tile_stride(long XI, long channels, long value_size)
    ctypedef struct lamina_wino_batch:
        const void* x
        const void* packed
        const void* bias
        void** xcl
        void** V
        void** M
        void* y
        long N, x_stride, y_stride, C, D, H, W, pd, ph, pw, Cp, Dp, Hp, Wp, TD, TH, TW, COp, cout, T, oD, oH, oW
        long next, pad_next, padded, rows_done
        int depth3, relu, accumulate, pool, split
    void wino_batch_member_f(void* job, int t, int nt)
    void wino_batch_member_d(void* job, int t, int nt)


def winograd_lanes(bint is_float):
    """The vector width the Winograd kernels pad channel counts to (and panel columns are twice)."""
    return 8 if is_float else 4


def winograd_workspace(int C, int cout, int D, int H, int W, int pd, int ph, int pw, bint depth3, int block,
                       bint is_float):
    """(xcl, V, M, packed) value counts of winograd_conv's scratch and transformed weights for one
    sample x [C, D, H, W] with padding (pd, ph, pw), tiles in blocks of `block`."""
    cdef long lanes = 8 if is_float else 4
    cdef long Cp = (C + lanes - 1) // lanes * lanes, COp = (cout + lanes - 1) // lanes * lanes
    cdef long XI = 64 if depth3 else 16
    cdef long panels = (COp + 2 * lanes - 1) // (2 * lanes)
    _, _, _, Dp, Hp, Wp = _winograd_grid(D, H, W, pd, ph, pw, depth3)
    cdef long size = 4 if is_float else 8
    return (Dp * Hp * Wp * Cp, block * lamina_wino_tile_stride(XI, Cp, size),
            block * lamina_wino_tile_stride(XI, COp, size), XI * panels * Cp * 2 * lanes)


cdef tuple _winograd_grid(long D, long H, long W, long pd, long ph, long pw, bint depth3):
    """(TD, TH, TW, Dp, Hp, Wp): the tiles along each axis (2 outputs each; one depth slice each
    for images) and the padded copy's sizes, which hold the input at (pd, ph, pw) and every tile's
    4 x 4 (x 4) read."""
    cdef long oD = D + 2 * pd - 2 if depth3 else D, oH = H + 2 * ph - 2, oW = W + 2 * pw - 2
    cdef long TD = (oD + 1) // 2 if depth3 else oD, TH = (oH + 1) // 2, TW = (oW + 1) // 2
    return (TD, TH, TW, max(2 * TD + 2, D + pd) if depth3 else D, max(2 * TH + 2, H + ph),
            max(2 * TW + 2, W + pw))


def winograd_conv(real[:, :, :, :, ::1] x, real[::1] packed, real[:, :, :, :, ::1] y, xcl, V, M, int pd, int ph,
                  int pw, bint depth3, int block,
                  bint accumulate=False, real[::1] bias=None, bint relu=False, int threads=1, bint pool=False):
    """y[n] [Cout, oD, oH, oW] = (or +=, accumulate) the stride-1 convolution of each sample x[n]
    [C, D, H, W] with a kernel of 3 along height and width (and depth when depth3; else 1 and
    pd = 0), padding (pd, ph, pw), by Winograd F(2, 3) (winograd.h); when overwriting, plus bias
    (None: none) and through a ReLU where relu is set. packed: the transformed, panel-packed
    weights; xcl, V, M: sequences of scratch arrays, one of each for each of `threads` (team.h),
    which take runs of samples (lamina_claim_run), or, for a batch smaller than the team, share
    each sample's rows of tiles (in xcl[0]). Sizes from winograd_workspace, all checked once
    for the samples. With `pool` (not with accumulate), y is the max pool of kernel 2 and stride 2
    of those outputs (along height and width, and depth when depth3; sizes rounded down), after
    the bias and the ReLU: each 2x2(x2) tile of the transform is one window."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], D = x.shape[2], H = x.shape[3], W = x.shape[4]
    cdef Py_ssize_t cout = y.shape[1], oD = y.shape[2], oH = y.shape[3], oW = y.shape[4]
    cdef long lanes = 8 if real is float else 4
    cdef long Cp = (C + lanes - 1) // lanes * lanes, COp = (cout + lanes - 1) // lanes * lanes
    cdef long TD, TH, TW, Dp, Hp, Wp
    if min(pd, ph, pw) < 0 or block < 1 or (not depth3 and pd != 0) or y.shape[0] != N:
        raise ValueError(f"winograd_conv: padding {(pd, ph, pw)} (depth 0 for images), block {block}, {N} input "
                         f"and {y.shape[0]} output samples")
    want = (D + 2 * pd - 2 if depth3 else D, H + 2 * ph - 2, W + 2 * pw - 2)
    if pool:
        if accumulate:
            raise ValueError("winograd_conv: a pooled output cannot be accumulated into")
        pooled = (want[0] // 2 if depth3 else want[0], want[1] // 2, want[2] // 2)
        if (oD, oH, oW) != pooled or min(pooled) < 1:
            raise ValueError(f"winograd_conv: an input {(D, H, W)} padded by {(pd, ph, pw)} gives outputs {want}, "
                             f"pooled {pooled}; found y {(oD, oH, oW)}")
        oD, oH, oW = want
    elif (oD, oH, oW) != want or min(want) < 1:
        raise ValueError(f"winograd_conv: an input {(D, H, W)} padded by {(pd, ph, pw)} gives outputs {want}, "
                         f"found y {(oD, oH, oW)}")
    need = winograd_workspace(C, cout, D, H, W, pd, ph, pw, depth3, block, real is float)
    if packed.shape[0] < need[3]:
        raise ValueError(f"winograd_conv: packed must hold at least {need[3]} values, found {packed.shape[0]}")
    cdef void* scratch[3][LAMINA_TEAM_MAX]
    _team_scratch("winograd_conv", "xcl", xcl, threads, <Py_ssize_t>need[0], scratch[0], &packed[0])
    _team_scratch("winograd_conv", "V", V, threads, <Py_ssize_t>need[1], scratch[1], &packed[0])
    _team_scratch("winograd_conv", "M", M, threads, <Py_ssize_t>need[2], scratch[2], &packed[0])
    if N == 0:
        return
    TD, TH, TW, Dp, Hp, Wp = _winograd_grid(D, H, W, pd, ph, pw, depth3)
    cdef real* b = _epilogue_bias("winograd_conv", bias, relu, cout, accumulate)
    cdef lamina_wino_batch job
    job.x, job.packed, job.bias, job.xcl, job.V, job.M = &x[0, 0, 0, 0, 0], &packed[0], b, scratch[0], scratch[1], scratch[2]
    job.y = &y[0, 0, 0, 0, 0]
    job.N, job.x_stride, job.y_stride = N, x.strides[0] // sizeof(real), y.strides[0] // sizeof(real)
    job.C, job.D, job.H, job.W, job.pd, job.ph, job.pw = C, D, H, W, pd, ph, pw
    job.Cp, job.Dp, job.Hp, job.Wp, job.TD, job.TH, job.TW = Cp, Dp, Hp, Wp, TD, TH, TW
    job.COp, job.cout, job.T, job.oD, job.oH, job.oW = COp, cout, block, oD, oH, oW
    job.next, job.pad_next, job.padded, job.rows_done = 0, 0, 0, 0
    job.depth3, job.relu, job.accumulate, job.pool = depth3, relu, accumulate, pool
    job.split = N < threads
    with nogil:
        lamina_team_run(threads, wino_batch_member_f if real is float else wino_batch_member_d, &job)


def direct_conv_dw_max_width():
    """The widest kernel direct_conv_dw takes."""
    return DW_MAX_KW


def direct_conv_dw_lanes(bint is_float, long out_width):
    """The widths of the vectors direct_conv_dw reads dy's rows in, for rows of out_width outputs
    (the caller pads them to a multiple): 16 in the AVX-512 build for float rows wider than 8
    (narrower ones would be half padding), else 8 for float and 4 for double."""
    if not is_float:
        return 4
    return DW_WIDE_LANES if DW_WIDE_LANES and out_width > 8 else 8


def direct_conv_dw_workspace(int cin_g, int cout_g, int kd, int kh, int kw, int lanes):
    """Values of scratch direct_conv_dw needs for its partial sums (per group), on vectors of
    `lanes` (direct_conv_dw_lanes)."""
    return ((cout_g + DW_CO_BLOCK - 1) // DW_CO_BLOCK) * cin_g * kd * kh * DW_CO_BLOCK * kw * lanes


def direct_conv_dw(real[:, :, :, ::1] x, real[:, :, :, ::1] dy, real[::1] dw, real[:, :, :, ::1] xp,
                   real[:, :, :, ::1] dyp, real[::1] partials, int groups, int kd, int kh, int kw, int sd, int sh,
                   int pd, int ph, int pw, int dd, int dh, int dw_):
    """dw [Cout, C/groups, kd, kh, kw] += the weight gradient of the unit-width-stride convolution
    of one sample x [C, D, H, W] given dy [Cout, oD, oH, oW], by direct_conv.h (kw at most
    DW_MAX_KW). xp: x padded as for direct_conv; dyp [Cout, oD, oH, oWp]: dy with rows padded
    by zeros to a multiple of direct_conv_dw_lanes(float?, oW); partials: direct_conv_dw_workspace
    values for those lanes."""
    cdef Py_ssize_t C = x.shape[0]
    cdef Py_ssize_t Dp = xp.shape[1], Hp = xp.shape[2], Wp = xp.shape[3]
    cdef Py_ssize_t cout = dy.shape[0], oD = dy.shape[1], oH = dy.shape[2], oWp = dyp.shape[3]
    cdef Py_ssize_t in_g, out_g, g
    cdef Py_ssize_t taps = kd * kh * kw
    cdef long geo[8]
    if groups < 1:
        raise ValueError(f"direct_conv_dw: groups must be at least 1, found {groups}")
    in_g, out_g = C // groups, cout // groups
    if kw > DW_MAX_KW:
        raise ValueError(f"direct_conv_dw: kernel width at most {DW_MAX_KW}, found {kw}")
    geo[:] = [kd, kh, kw, sd, sh, dd, dh, dw_]
    _check_padded("direct_conv_dw (x)", _dims(x), _dims(xp), pd, ph, pw, 1)
    _check_padded("direct_conv_dw (dy)", _dims(dy), _dims(dyp), 0, 0, 0, 1)
    cdef long lanes = direct_conv_dw_lanes(real is float, dy.shape[3])
    if groups < 1 or C % groups or cout % groups or min(kd, kh, kw, sd, sh, dd, dh, dw_) < 1 or oWp % lanes:
        raise ValueError(f"direct_conv_dw: {C} input and {cout} output channels in {groups} groups, geometry "
                         f"{[geo[i] for i in range(8)]}, padded dy rows of {oWp} (a multiple of {lanes})")
    last = ((oD - 1) * sd + (kd - 1) * dd, (oH - 1) * sh + (kh - 1) * dh, oWp - 1 + (kw - 1) * dw_)
    if last[0] >= Dp or last[1] >= Hp or last[2] >= Wp:
        raise ValueError(f"direct_conv_dw: dy {_dims(dy)[1:]} reads the padded input up to {last}, outside "
                         f"its {(Dp, Hp, Wp)}")
    scratch = direct_conv_dw_workspace(in_g, out_g, kd, kh, kw, lanes)
    if dw.shape[0] != cout * in_g * taps or partials.shape[0] < scratch:
        raise ValueError(f"direct_conv_dw: dw must hold {cout * in_g * taps} values and partials {scratch}, found "
                         f"{dw.shape[0]} and {partials.shape[0]}")
    with nogil:
        _padded_copy(x, xp, pd, ph, pw)
        _padded_copy(dy, dyp, 0, 0, 0)
        for g in range(groups):
            if real is float and lanes == 16:
                direct_conv_dw_f16(&xp[g * in_g, 0, 0, 0], in_g, Dp, Hp, Wp, &dyp[g * out_g, 0, 0, 0], out_g, oD,
                                   oH, oWp, geo, &partials[0], &dw[g * out_g * in_g * taps])
            elif real is float:
                direct_conv_dw_f(&xp[g * in_g, 0, 0, 0], in_g, Dp, Hp, Wp, &dyp[g * out_g, 0, 0, 0], out_g, oD, oH,
                                 oWp, geo, &partials[0], &dw[g * out_g * in_g * taps])
            else:
                direct_conv_dw_d(&xp[g * in_g, 0, 0, 0], in_g, Dp, Hp, Wp, &dyp[g * out_g, 0, 0, 0], out_g, oD, oH,
                                 oWp, geo, &partials[0], &dw[g * out_g * in_g * taps])


cdef inline void _bias_planes(real* y, const real* b, long C, long S, double beta, long p0, long p1) noexcept nogil:
    cdef long p, i
    cdef real bc, scale = <real>beta
    cdef real* row
    for p in range(p0, p1):
        bc, row = b[p % C], y + p * S
        if beta == 0:
            for i in range(S):
                row[i] = bc
        elif beta == 1:
            for i in range(S):
                row[i] += bc
        else:
            for i in range(S):
                row[i] = scale * row[i] + bc


ctypedef struct _bias_job:
    bint single                    # float32 arrays (else float64)
    void* y                        # [N, C, S]
    const void* b                  # [C]
    long C, S
    double beta


cdef void _channel_bias_planes(void* args, int t, long p0, long p1) noexcept nogil:
    """channel_bias over the (sample, channel) planes p0 .. p1."""
    cdef _bias_job* j = <_bias_job*>args
    if j.single:
        _bias_planes(<float*>j.y, <const float*>j.b, j.C, j.S, j.beta, p0, p1)
    else:
        _bias_planes(<double*>j.y, <const double*>j.b, j.C, j.S, j.beta, p0, p1)


def channel_bias(real[:, :, ::1] y, real[::1] b, double beta=1.0):
    """y[n, c, :] = beta·y[n, c, :] + b[c] (y viewed as [N, C, spatial]); beta 0 overwrites y
    (what it held, NaN included, is not read). Planes shared by the team from PARALLEL_MIN values."""
    cdef _bias_job j
    j.C, j.S = y.shape[1], y.shape[2]
    if y.shape[0] * j.C * j.S == 0:
        return
    j.single, j.y, j.b, j.beta = real is float, &y[0, 0, 0], &b[0], beta
    with nogil:
        lamina_team_for(_threads_for(y.shape[0] * j.C * j.S > PARALLEL_MIN), y.shape[0] * j.C, _channel_bias_planes,
                        &j)


def channel_bias_grad(real[:, :, ::1] dy, real[::1] db, double beta):
    """db[c] = sum over n and spatial of dy[n, c, :] (with beta), accumulated in double."""
    cdef Py_ssize_t n, c, N = dy.shape[0], C = dy.shape[1], S = dy.shape[2]
    cdef double acc
    for c in prange(C, nogil=True, schedule="static", use_threads_if=N * C * S > PARALLEL_MIN):
        acc = 0
        for n in range(N):  # (bounds are not checked: with S = 0 the row is never read)
            if real is float:
                acc = acc + lamina_sum_f(&dy[n, c, 0], S)
            else:
                acc = acc + lamina_sum_d(&dy[n, c, 0], S)
        db[c] = <real>(acc if beta == 0 else acc + beta * db[c])


# ---------------------------------------------------------------- pooling over volumes
# x is [planes, D, H, W] (planes = N * C); out [planes, oD, oH, oW]; windows of k with stride s
# and padding p (a 2-D pool is depth 1).

cdef extern from "pools.h" nogil:
    void max_pool_inside_f(const float* x, long D, long H, long W, float* out, int* argmax, long oD, long oH, long oW,
                           const long* geo)
    void max_pool_inside_d(const double* x, long D, long H, long W, double* out, int* argmax, long oD, long oH, long oW,
                           const long* geo)
    void max_pool_row_f(const float* x, long H, long W, long p0, long n, long sw, const long* geo, float* o, int* am)
    void max_pool_row_d(const double* x, long H, long W, long p0, long n, long sw, const long* geo, double* o, int* am)


def _check_pool_windows(str where, Py_ssize_t D, Py_ssize_t H, Py_ssize_t W, Py_ssize_t oD, Py_ssize_t oH,
                        Py_ssize_t oW, int kd, int kh, int kw, int sd, int sh, int sw, int dd, int dh, int dw):
    """Kernel sizes, strides and dilations of at least 1, and sizes of at least 1."""
    if min(kd, kh, kw, sd, sh, sw, dd, dh, dw) < 1 or min(D, H, W, oD, oH, oW) < 1:
        raise ValueError(f"{where}: kernel ({kd}, {kh}, {kw}), stride ({sd}, {sh}, {sw}) and dilation ({dd}, {dh}, "
                         f"{dw}) must be at least 1, and the input {D}x{H}x{W} and output {oD}x{oH}x{oW} not empty")


def max_pool(real[:, :, :, ::1] x, real[:, :, :, ::1] out, int[:, ::1] argmax,
             int kd, int kh, int kw, int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw):
    """out = the maximum over each window (padding never wins; taps dd, dh, dw apart); argmax
    keeps its flat position in the plane for backward (None: not kept, for inference)."""
    cdef Py_ssize_t P = x.shape[0], D = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef Py_ssize_t oD = out.shape[1], oH = out.shape[2], oW = out.shape[3]
    cdef Py_ssize_t q, od, oh, ow, a, b, e, i_d, i_h, i_w, best_at, o
    cdef real best
    cdef bint keep = argmax is not None
    # without padding before, and with the last window ending inside (no padding after, no
    # ceil mode), every window lies inside the volume: plain pointer arithmetic, no bounds
    _check_pool_windows("max_pool", D, H, W, oD, oH, oW, kd, kh, kw, sd, sh, sw, dd, dh, dw)
    cdef bint inside = (pd == 0 and ph == 0 and pw == 0 and dd == 1 and dh == 1 and dw == 1
                        and (oD - 1) * sd + kd <= D and (oH - 1) * sh + kh <= H and (oW - 1) * sw + kw <= W)
    cdef long geo[6]
    geo[:] = [kd, kh, kw, sd, sh, sw]
    if inside:  # pools.h, tap by tap over output rows
        for q in prange(P, nogil=True, schedule="static", use_threads_if=P * D * H * W > PARALLEL_MIN):
            if real is float:
                max_pool_inside_f(&x[q, 0, 0, 0], D, H, W, &out[q, 0, 0, 0], &argmax[q, 0] if keep else NULL,
                                  oD, oH, oW, geo)
            else:
                max_pool_inside_d(&x[q, 0, 0, 0], D, H, W, &out[q, 0, 0, 0], &argmax[q, 0] if keep else NULL,
                                  oD, oH, oW, geo)
        return
    # otherwise, along each output row whose windows lie inside along depth and height, the
    # windows [lo, hi) that lie inside along the width too run as pools.h's rows; the rest tap by
    # tap with bounds
    cdef long taps[6]
    taps[:] = [kd, kh, kw, dd, dh, dw]
    cdef Py_ssize_t lo, hi, last = W - 1 - (kw - 1) * dw + pw  # the last window start inside, padded
    cdef Py_ssize_t first_inside = (pw + sw - 1) // sw, past_inside = last // sw + 1 if last >= 0 else 0
    for q in prange(P, nogil=True, schedule="static", use_threads_if=P * D * H * W > PARALLEL_MIN):
        for od in range(oD):
            for oh in range(oH):
                lo = hi = 0
                i_d = od * sd - pd
                i_h = oh * sh - ph
                if 0 <= i_d and i_d + (kd - 1) * dd < D and 0 <= i_h and i_h + (kh - 1) * dh < H \
                        and first_inside < min(past_inside, oW):
                    lo = first_inside
                    hi = min(past_inside, oW)
                    o = (od * oH + oh) * oW + lo
                    if real is float:
                        max_pool_row_f(&x[q, 0, 0, 0], H, W, (i_d * H + i_h) * W + lo * sw - pw, hi - lo, sw, taps,
                                       &out[q, od, oh, lo], &argmax[q, o] if keep else NULL)
                    else:
                        max_pool_row_d(&x[q, 0, 0, 0], H, W, (i_d * H + i_h) * W + lo * sw - pw, hi - lo, sw, taps,
                                       &out[q, od, oh, lo], &argmax[q, o] if keep else NULL)
                for ow in range(oW):
                    if lo <= ow < hi:
                        continue
                    o = (od * oH + oh) * oW + ow
                    best_at = -1
                    best = 0
                    for a in range(kd):
                        i_d = od * sd - pd + a * dd
                        if i_d < 0 or i_d >= D:
                            continue
                        for b in range(kh):
                            i_h = oh * sh - ph + b * dh
                            if i_h < 0 or i_h >= H:
                                continue
                            for e in range(kw):
                                i_w = ow * sw - pw + e * dw
                                if i_w < 0 or i_w >= W:
                                    continue
                                if best_at < 0 or x[q, i_d, i_h, i_w] > best:
                                    best = x[q, i_d, i_h, i_w]
                                    best_at = (i_d * H + i_h) * W + i_w
                    out[q, od, oh, ow] = best
                    if keep:
                        argmax[q, o] = <int>best_at


def max_pool_backward(real[:, :, :, ::1] dy, int[:, ::1] argmax, real[:, ::1] dx, double beta):
    """dx[plane, argmax] += dy (dx viewed as [planes, D*H*W]; with beta: 0 clears dx first)."""
    cdef Py_ssize_t P = dy.shape[0], Q = dy.shape[1] * dy.shape[2] * dy.shape[3], S = dx.shape[1]
    cdef Py_ssize_t q, i
    cdef real* flat
    for q in prange(P, nogil=True, schedule="static", use_threads_if=P * S > PARALLEL_MIN):
        if beta == 0:
            for i in range(S):
                dx[q, i] = 0
        elif beta != 1:
            for i in range(S):
                dx[q, i] = <real>(beta * dx[q, i])
        flat = &dy[q, 0, 0, 0]
        for i in range(Q):
            dx[q, argmax[q, i]] += flat[i]


def avg_pool(real[:, :, :, ::1] x, real[:, :, :, ::1] out, int kd, int kh, int kw, int sd, int sh, int sw,
             int pd, int ph, int pw, int dd, int dh, int dw, bint count_include_pad):
    """out = the mean over each window (taps dd, dh, dw apart); the divisor counts padded
    positions or not."""
    cdef Py_ssize_t P = x.shape[0], D = x.shape[1], H = x.shape[2], W = x.shape[3]
    cdef Py_ssize_t oD = out.shape[1], oH = out.shape[2], oW = out.shape[3]
    cdef Py_ssize_t q, od, oh, ow, a, b, e, i_d, i_h, i_w, n
    cdef double acc
    _check_pool_windows("avg_pool", D, H, W, oD, oH, oW, kd, kh, kw, sd, sh, sw, dd, dh, dw)
    for q in prange(P, nogil=True, schedule="static", use_threads_if=P * D * H * W > PARALLEL_MIN):
        for od in range(oD):
            for oh in range(oH):
                for ow in range(oW):
                    acc = 0
                    n = 0
                    for a in range(kd):
                        i_d = od * sd - pd + a * dd
                        for b in range(kh):
                            i_h = oh * sh - ph + b * dh
                            for e in range(kw):
                                i_w = ow * sw - pw + e * dw
                                if 0 <= i_d < D and 0 <= i_h < H and 0 <= i_w < W:
                                    acc = acc + x[q, i_d, i_h, i_w]
                                    n = n + 1
                    out[q, od, oh, ow] = <real>(acc / (kd * kh * kw if count_include_pad else n))


def avg_pool_backward(real[:, :, :, ::1] dy, real[:, :, :, ::1] dx, int kd, int kh, int kw,
                      int sd, int sh, int sw, int pd, int ph, int pw, int dd, int dh, int dw, bint count_include_pad,
                      double beta):
    """dx = each window's dy spread evenly over the window (with beta: 0 clears dx first)."""
    cdef Py_ssize_t P = dx.shape[0], D = dx.shape[1], H = dx.shape[2], W = dx.shape[3]
    cdef Py_ssize_t oD = dy.shape[1], oH = dy.shape[2], oW = dy.shape[3]
    cdef Py_ssize_t q, od, oh, ow, a, b, e, i_d, i_h, i_w, n
    cdef double share
    _check_pool_windows("avg_pool_backward", D, H, W, oD, oH, oW, kd, kh, kw, sd, sh, sw, dd, dh, dw)
    for q in prange(P, nogil=True, schedule="static", use_threads_if=P * D * H * W > PARALLEL_MIN):
        for i_d in range(D):
            for i_h in range(H):
                for i_w in range(W):
                    dx[q, i_d, i_h, i_w] = 0 if beta == 0 else <real>(beta * dx[q, i_d, i_h, i_w])
        for od in range(oD):
            for oh in range(oH):
                for ow in range(oW):
                    n = 0
                    if count_include_pad:
                        n = kd * kh * kw
                    else:
                        for a in range(kd):
                            for b in range(kh):
                                for e in range(kw):
                                    if (0 <= od * sd - pd + a * dd < D and 0 <= oh * sh - ph + b * dh < H
                                            and 0 <= ow * sw - pw + e * dw < W):
                                        n = n + 1
                    share = dy[q, od, oh, ow] / n
                    for a in range(kd):
                        i_d = od * sd - pd + a * dd
                        for b in range(kh):
                            i_h = oh * sh - ph + b * dh
                            for e in range(kw):
                                i_w = ow * sw - pw + e * dw
                                if 0 <= i_d < D and 0 <= i_h < H and 0 <= i_w < W:
                                    dx[q, i_d, i_h, i_w] += <real>share


# ---------------------------------------------------------------- batch normalisation
# x is [N, C, S] (S = spatial size); statistics per channel over N and S.

def batch_norm_stats(real[:, :, ::1] x, double[::1] mean, double[::1] var):
    """Per-channel mean and biased variance (two passes, in double)."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c
    cdef double acc, m
    for c in prange(C, nogil=True, schedule="static", use_threads_if=N * C * S > PARALLEL_MIN):
        acc = 0
        for n in range(N):
            if real is float:
                acc = acc + lamina_sum_f(&x[n, c, 0], S)
            else:
                acc = acc + lamina_sum_d(&x[n, c, 0], S)
        m = acc / (N * S)
        acc = 0
        for n in range(N):
            if real is float:
                acc = acc + lamina_sum_sq_dev_f(&x[n, c, 0], S, m)
            else:
                acc = acc + lamina_sum_sq_dev_d(&x[n, c, 0], S, m)
        mean[c] = m
        var[c] = acc / (N * S)


def batch_norm_apply(real[:, :, ::1] x, double[::1] mean, double[::1] invstd, real[::1] gamma,
                     real[::1] beta_, bint affine, real[:, :, ::1] y, bint relu=False):
    """y = (x - mean) * invstd * gamma + beta (gamma 1, beta 0 without affine), through a ReLU
    where relu is set (0 where negative: NaN stays NaN, as the activation kernel's)."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c, i
    cdef double scale, shift
    cdef real a, b, v
    for c in prange(C, nogil=True, schedule="static", use_threads_if=N * C * S > PARALLEL_MIN):
        scale = invstd[c] * (gamma[c] if affine else 1.0)
        shift = (beta_[c] if affine else 0.0) - mean[c] * scale
        a = <real>scale  # in the data's type: the loop below is one multiply-add per value
        b = <real>shift
        for n in range(N):
            if relu:
                for i in range(S):
                    v = x[n, c, i] * a + b
                    y[n, c, i] = 0 if v < 0 else v
            else:
                for i in range(S):
                    y[n, c, i] = x[n, c, i] * a + b


def batch_norm_backward(real[:, :, ::1] x, real[:, :, ::1] dy, double[::1] mean, double[::1] invstd,
                        real[::1] gamma, bint affine, bint batch_stats, real[:, :, ::1] dx, double beta,
                        double[::1] dgamma, double[::1] dbeta):
    """dgamma = Σ dy x̂, dbeta = Σ dy. dx with batch statistics:
    invstd·γ/M (M dy - Σ dy - x̂ Σ dy x̂); with fixed (running) statistics: invstd·γ dy."""
    cdef Py_ssize_t N = x.shape[0], C = x.shape[1], S = x.shape[2], n, c, i
    cdef double sdy, sdyx, xhat, g, M = N * S, v
    for c in prange(C, nogil=True, schedule="static", use_threads_if=N * C * S > PARALLEL_MIN):
        sdy = 0
        sdyx = 0
        for n in range(N):
            for i in range(S):
                xhat = (x[n, c, i] - mean[c]) * invstd[c]
                sdy = sdy + dy[n, c, i]
                sdyx = sdyx + dy[n, c, i] * xhat
        dgamma[c] = sdyx
        dbeta[c] = sdy
        g = invstd[c] * (gamma[c] if affine else 1.0)
        for n in range(N):
            for i in range(S):
                if batch_stats:
                    xhat = (x[n, c, i] - mean[c]) * invstd[c]
                    v = g * (dy[n, c, i] - sdy / M - xhat * sdyx / M)
                else:
                    v = g * dy[n, c, i]
                if beta == 0:
                    dx[n, c, i] = <real>v
                else:
                    dx[n, c, i] = <real>(v + beta * dx[n, c, i])
