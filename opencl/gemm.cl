/* C = alpha op(A) op(B) + beta C, row-major, op = identity or transpose: lamina's GEMM on
 * OpenCL devices (OpenCL C 1.2).
 *
 * Each work-group computes a TSM x TSN tile of C from TSK-deep tiles of op(A) and op(B) staged in
 * local memory; each work-item keeps a WPTM x WPTN block of C in registers (2-D register
 * blocking, after Nugteren's "myGEMM" kernels), so every value loaded from local memory feeds
 * several multiply-adds. Dimension 0 runs along the columns of C, so neighbouring work-items
 * touch neighbouring addresses when they store. Tiles that hang over the matrix edges are
 * padded with zeros, so any M, N, K work. beta == 0 never reads C.
 *
 * Compile-time options (-D): REAL (float or double), TSM, TSN, TSK, WPTM, WPTN.
 */
#include "common.h"
#ifndef TSM
#define TSM 64
#endif
#ifndef TSN
#define TSN 64
#endif
#ifndef TSK
#define TSK 16
#endif
#ifndef WPTM
#define WPTM 8
#endif
#ifndef WPTN
#define WPTN 8
#endif
#if TSM % 4 || TSN % 4 || TSK % 4
#error "the tiled GEMM loads its tiles four values at a time: TSM, TSN and TSK must be multiples of 4"
#endif
#ifdef USE_DOUBLE
#define REAL4 double4
#else
#define REAL4 float4
#endif
#define RTSM (TSM / WPTM)
#define RTSN (TSN / WPTN)
#define THREADS (RTSM * RTSN)

__kernel __attribute__((reqd_work_group_size(RTSN, RTSM, 1)))
void gemm(const int M, const int N, const int K, const REAL alpha,
          __global const REAL* restrict A, const int offa, const int lda, const int trans_a,
          __global const REAL* restrict B, const int offb, const int ldb, const int trans_b,
          const REAL beta, __global REAL* restrict C, const int offc, const int ldc)
{
    const int tn = get_local_id(0), tm = get_local_id(1);
    const int tid = tm * RTSN + tn;
    const int m0 = TSM * get_group_id(1), n0 = TSN * get_group_id(0);
    A += offa;
    B += offb;
    C += offc;
    /* a column of padding: work-items storing along k (A read row by row, B transposed) hit
     * neighbouring banks instead of one bank TSM (TSN) values apart */
    __local REAL Asub[TSK][TSM + 1];
    __local REAL Bsub[TSK][TSN + 1];
    REAL acc[WPTM][WPTN];
    for (int wm = 0; wm < WPTM; wm++)
        for (int wn = 0; wn < WPTN; wn++)
            acc[wm][wn] = 0;

    for (int k0 = 0; k0 < K; k0 += TSK) {
        /* stage op(A)[m0:m0+TSM, k0:k0+TSK] and op(B)[k0:k0+TSK, n0:n0+TSN]: four neighbours
         * along the axis each operand is contiguous in with one vector load where the tile lies
         * within the matrix along that axis (the branch is the same for the whole work-group),
         * one value at a time at the edges */
        if (!trans_a && k0 + TSK <= K) {
            for (int l = tid; l < TSM * (TSK / 4); l += THREADS) {
                const int mm = l / (TSK / 4), kk = l % (TSK / 4) * 4, i = m0 + mm;
                const REAL4 v = i < M ? vload4(0, A + i * lda + k0 + kk) : (REAL4)0;
                Asub[kk][mm] = v.x; Asub[kk + 1][mm] = v.y; Asub[kk + 2][mm] = v.z; Asub[kk + 3][mm] = v.w;
            }
        } else if (trans_a && m0 + TSM <= M) {
            for (int l = tid; l < TSK * (TSM / 4); l += THREADS) {
                const int kk = l / (TSM / 4), mm = l % (TSM / 4) * 4, k = k0 + kk;
                vstore4(k < K ? vload4(0, A + k * lda + m0 + mm) : (REAL4)0, 0, &Asub[kk][mm]);
            }
        } else {
            for (int l = tid; l < TSK * TSM; l += THREADS) {
                const int kk = trans_a ? l / TSM : l % TSK, mm = trans_a ? l % TSM : l / TSK;
                const int i = m0 + mm, k = k0 + kk;
                Asub[kk][mm] = (i < M && k < K) ? (trans_a ? A[k * lda + i] : A[i * lda + k]) : (REAL)0;
            }
        }
        if (!trans_b && n0 + TSN <= N) {
            for (int l = tid; l < TSK * (TSN / 4); l += THREADS) {
                const int kk = l / (TSN / 4), nn = l % (TSN / 4) * 4, k = k0 + kk;
                vstore4(k < K ? vload4(0, B + k * ldb + n0 + nn) : (REAL4)0, 0, &Bsub[kk][nn]);
            }
        } else if (trans_b && k0 + TSK <= K) {
            for (int l = tid; l < TSN * (TSK / 4); l += THREADS) {
                const int nn = l / (TSK / 4), kk = l % (TSK / 4) * 4, j = n0 + nn;
                const REAL4 v = j < N ? vload4(0, B + j * ldb + k0 + kk) : (REAL4)0;
                Bsub[kk][nn] = v.x; Bsub[kk + 1][nn] = v.y; Bsub[kk + 2][nn] = v.z; Bsub[kk + 3][nn] = v.w;
            }
        } else {
            for (int l = tid; l < TSK * TSN; l += THREADS) {
                const int kk = trans_b ? l % TSK : l / TSN, nn = trans_b ? l / TSK : l % TSN;
                const int j = n0 + nn, k = k0 + kk;
                Bsub[kk][nn] = (j < N && k < K) ? (trans_b ? B[j * ldb + k] : B[k * ldb + j]) : (REAL)0;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int kk = 0; kk < TSK; kk++) {
            REAL a[WPTM], b[WPTN];
            for (int wm = 0; wm < WPTM; wm++)
                a[wm] = Asub[kk][tm + wm * RTSM];
            for (int wn = 0; wn < WPTN; wn++)
                b[wn] = Bsub[kk][tn + wn * RTSN];
            for (int wm = 0; wm < WPTM; wm++)
                for (int wn = 0; wn < WPTN; wn++)
                    acc[wm][wn] = mad(a[wm], b[wn], acc[wm][wn]);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    for (int wm = 0; wm < WPTM; wm++) {
        const int i = m0 + tm + wm * RTSM;
        if (i >= M)
            continue;
        for (int wn = 0; wn < WPTN; wn++) {
            const int j = n0 + tn + wn * RTSN;
            if (j < N) {
                const REAL v = alpha * acc[wm][wn];
                C[i * ldc + j] = beta == 0 ? v : v + beta * C[i * ldc + j];
            }
        }
    }
}

/* The same product for CPU devices (PoCL and other CPU OpenCL drivers), which turn the
 * work-items of a group into a loop and vectorise it: no local memory and no barriers (both
 * cost a CPU driver more than they save), one column of C per work-item, so neighbouring
 * work-items read neighbouring elements of B (one vector load) and share the element of A
 * (a broadcast), and RPW rows of C per work-item held in registers, so each load of B feeds
 * RPW multiply-adds. -D RPW (rows per work-item). */
#ifndef RPW
#define RPW 8
#endif

__kernel void gemm_rows(const int M, const int N, const int K, const REAL alpha,
                        __global const REAL* restrict A, const int offa, const int lda, const int trans_a,
                        __global const REAL* restrict B, const int offb, const int ldb, const int trans_b,
                        const REAL beta, __global REAL* restrict C, const int offc, const int ldc)
{
    const int j = min((int)get_global_id(0), N - 1);  /* extra work-items redo the last column */
    const int i0 = get_global_id(1) * RPW;
    A += offa;
    B += offb;
    C += offc;
    int rows[RPW];
    for (int r = 0; r < RPW; r++)
        rows[r] = min(i0 + r, M - 1);  /* rows past the end repeat the last one; never stored */
    REAL acc[RPW];
    for (int r = 0; r < RPW; r++)
        acc[r] = 0;
    for (int k = 0; k < K; k++) {
        const REAL b = trans_b ? B[j * ldb + k] : B[k * ldb + j];
        for (int r = 0; r < RPW; r++)
            acc[r] += (trans_a ? A[k * lda + rows[r]] : A[rows[r] * lda + k]) * b;
    }
    if ((int)get_global_id(0) >= N)
        return;
    for (int r = 0; r < RPW; r++) {
        const int i = i0 + r;
        if (i < M) {
            const REAL v = alpha * acc[r];
            C[i * ldc + j] = beta == 0 ? v : v + beta * C[i * ldc + j];
        }
    }
}

/* gemm_rows with explicit 8-wide vectors (for CPU devices when N is a multiple of 8 and B is
 * not transposed): each work-item computes RPW rows x 8 columns of C, one vload8 of B and RPW
 * broadcasts of A per step of k. */
#ifndef VW
#define VW 8
#endif
#if defined(USE_DOUBLE)
#define REAL8 double8
#else
#define REAL8 float8
#endif
#define VTYPE_(t, w) t##w
#define VTYPE(t, w) VTYPE_(t, w)
#define VLOAD_(w) vload##w
#define VLOAD(w) VLOAD_(w)
#define VSTORE_(w) vstore##w
#define VSTORE(w) VSTORE_(w)

__kernel void gemm_rows8(const int M, const int N, const int K, const REAL alpha,
                         __global const REAL* restrict A, const int offa, const int lda, const int trans_a,
                         __global const REAL* restrict B, const int offb, const int ldb, const int trans_b,
                         const REAL beta, __global REAL* restrict C, const int offc, const int ldc)
{
    const int j = get_global_id(0) * VW;
    const int i0 = get_global_id(1) * RPW;
    if (j >= N)
        return;
    A += offa;
    B += offb;
    C += offc;
    int rows[RPW];
    for (int r = 0; r < RPW; r++)
        rows[r] = min(i0 + r, M - 1);
    VTYPE(REAL, VW) acc[RPW];
    for (int r = 0; r < RPW; r++)
        acc[r] = (VTYPE(REAL, VW))(0);
    for (int k = 0; k < K; k++) {
        const VTYPE(REAL, VW) b = VLOAD(VW)(0, B + k * ldb + j);
        for (int r = 0; r < RPW; r++)
            acc[r] += (trans_a ? A[k * lda + rows[r]] : A[rows[r] * lda + k]) * b;
    }
    for (int r = 0; r < RPW; r++) {
        const int i = i0 + r;
        if (i < M) {
            const VTYPE(REAL, VW) v = alpha * acc[r];
            VSTORE(VW)(beta == 0 ? v : v + beta * VLOAD(VW)(0, C + i * ldc + j), 0, C + i * ldc + j);
        }
    }
}

/* For CPU devices, the fastest form: op(B) first copied into panels of PW = CV·VW columns
 * (panel p holds columns [p·PW, p·PW + PW) of op(B), K rows of PW contiguous values, zero past
 * column N), so the product reads B at consecutive addresses instead of one row apart (rows a
 * power of two apart alias in the cache); then each work-item keeps an RPW x PW block of C in
 * registers, loading CV vectors of the panel and RPW values of A per step of k. Dimension 0
 * walks down the rows of C, so consecutive work-items reuse one panel from the cache. A is as
 * stored (not transposed); N a multiple of VW. */
#ifndef CV
#define CV 2
#endif
#define PW (CV * VW)

__kernel void pack_panels(__global const REAL* restrict B, const int offb, const int ldb, const int trans_b,
                          const int K, const int N, __global REAL* restrict P)
{
    const int j = get_global_id(0), k = get_global_id(1);
    const int panels = (N + PW - 1) / PW;
    if (j >= panels * PW || k >= K) return;
    B += offb;
    P[((j / PW) * K + k) * PW + j % PW] = j < N ? (trans_b ? B[j * ldb + k] : B[k * ldb + j]) : (REAL)0;
}

__kernel void gemm_panels(const int M, const int N, const int K, const REAL alpha,
                          __global const REAL* restrict A, const int offa, const int lda,
                          __global const REAL* restrict P, const REAL beta,
                          __global REAL* restrict C, const int offc, const int ldc)
{
    const int i0 = get_global_id(0) * RPW;
    const int panel = get_global_id(1), j = panel * PW;
    if (j >= N)
        return;
    A += offa;
    C += offc;
    __global const REAL* arow[RPW];
    for (int r = 0; r < RPW; r++)
        arow[r] = A + min(i0 + r, M - 1) * lda;
    __global const REAL* bp = P + panel * K * PW;
    VTYPE(REAL, VW) acc[RPW][CV];
    for (int r = 0; r < RPW; r++)
        for (int v = 0; v < CV; v++)
            acc[r][v] = (VTYPE(REAL, VW))(0);
    for (int k = 0; k < K; k++) {
        VTYPE(REAL, VW) b[CV];
        for (int v = 0; v < CV; v++)
            b[v] = VLOAD(VW)(0, bp + k * PW + v * VW);
        for (int r = 0; r < RPW; r++) {
            const REAL a = arow[r][k];
            for (int v = 0; v < CV; v++)
                acc[r][v] += a * b[v];
        }
    }
    for (int r = 0; r < RPW; r++) {
        const int i = i0 + r;
        if (i >= M)
            continue;
        for (int v = 0; v < CV; v++) {
            if (j + v * VW >= N)
                break;
            __global REAL* c = C + i * ldc + j + v * VW;
            const VTYPE(REAL, VW) out = alpha * acc[r][v];
            VSTORE(VW)(beta == 0 ? out : out + beta * VLOAD(VW)(0, c), 0, c);
        }
    }
}
