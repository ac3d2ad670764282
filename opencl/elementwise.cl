/* lamina's element-wise, row and optimizer kernels on OpenCL devices (OpenCL C 1.2).
 * The same conventions as the CPU kernels (lamina.backends.base): row-major arrays, outputs
 * written "with beta" (out = new + beta * out; beta == 0 never reads out). Sizes come as int
 * arguments; one work-item per element, row or column as each kernel says.
 * Every array comes as (buffer, offset in elements), so views into larger arrays (a step's rows
 * of a sequence batch) work as they are.
 * -D REAL=float|double; ACC is the accumulation type of reductions.
 */
#include "common.h"

#define ACC REAL


/* activation codes: the positions in lamina.backends.base.ACTIVATIONS */
#define LINEAR 0
#define SIGMOID 1
#define TANH 2
#define RELU 3
#define LEAKY_RELU 4
#define EXPONENTIAL 5
#define SOFTRELU 6
#define ELU 7
#define SELU 8
#define SOFTSIGN 9
#define HARD_SIGMOID 10
#define GELU 11
#define HARD_SWISH 12
#define GELU_TANH 13
#define BOUNDED_RELU 14
#define SQRT 15
#define RECIPROCAL 16
#define LOG 17
#define ABS 18
#define ERF 19
#define GELU_TANH_C 0.7978845608028654 /* √(2/π) */
#define SELU_ALPHA 1.6732632423543772
#define SELU_SCALE 1.0507009873554805

/* v clipped to [0, 1] (NaN stays NaN) */
inline REAL unit_clip(const REAL v) { return v < 0 ? 0 : (v > 1 ? 1 : v); }

__kernel void fill(ARG(REAL, x), const REAL value, const int n)
{
    AT(REAL, x);
    const int i = get_global_id(0);
    if (i < n) x[i] = value;
}

__kernel void axpby(const REAL alpha, ARG(const REAL, x), const REAL beta, ARG(REAL, y), const int n)
{
    AT(const REAL, x);
    AT(REAL, y);
    const int i = get_global_id(0);
    if (i < n) y[i] = WITH_BETA(y[i], alpha * x[i], beta);
}

__kernel void multiply(ARG(const REAL, a), ARG(const REAL, b), ARG(REAL, out), const REAL beta, const int n)
{
    AT(const REAL, a);
    AT(const REAL, b);
    AT(REAL, out);
    const int i = get_global_id(0);
    if (i < n) out[i] = WITH_BETA(out[i], a[i] * b[i], beta);
}

/* out = a where cond > 0, else b (NaN in cond: b); a and b hold n values or one row of na (nb)
 * values that every row reads: entry i % na (named apart from OpenCL C's built-in select) */
__kernel void select_values(ARG(const REAL, cond), ARG(const REAL, a), const int na, ARG(const REAL, b), const int nb,
                     ARG(REAL, out), const int n)
{
    AT(const REAL, cond);
    AT(const REAL, a);
    AT(const REAL, b);
    AT(REAL, out);
    const int i = get_global_id(0);
    if (i < n) out[i] = cond[i] > 0 ? a[i % na] : b[i % nb];
}

/* y = x rounded to the nearest bfloat16 value (ties to even), float32 only; NaN stays NaN */
__kernel void round_to_bfloat16(__global const uint *x, const int x_offset, __global uint *y, const int y_offset,
                                const int n)
{
    const int i = get_global_id(0);
    if (i >= n) return;
    const uint u = x[x_offset + i];
    y[y_offset + i] = (u & 0x7fffffffu) > 0x7f800000u ? (u | 0x00400000u) & 0xffff0000u
                                                      : ((u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u);
}

/* Each row of x (rows x k) as integers q times the row's scale (lamina.precision.quantize_rows):
 * symmetric, the row's largest magnitude is `levels` steps; else the row's range widened to hold
 * 0 is `levels` steps, with a zero point, and q is the u8 value less it. One work-item per row. */
__kernel void quantize_rows(ARG(const REAL, x), ARG(REAL, q), ARG(REAL, scales), const int rows, const int k,
                            const int levels, const int symmetric)
{
    AT(const REAL, x);
    AT(REAL, q);
    AT(REAL, scales);
    const int i = get_global_id(0);
    if (i >= rows) return;
    __global const REAL *xi = x + (long)i * k;
    __global REAL *qi = q + (long)i * k;
    REAL lo = 0, hi = 0, bad = 0;
    for (int j = 0; j < k; j++) {
        lo = xi[j] < lo ? xi[j] : lo;
        hi = xi[j] > hi ? xi[j] : hi;
        bad += xi[j] - xi[j];  /* NaN once a value is NaN or infinite: the scale is then NaN */
    }
    const REAL range = symmetric ? (-lo > hi ? -lo : hi) / (REAL)levels : (hi - lo) / (REAL)levels;
    const REAL scale = isnan(bad) ? NAN : range;
    const REAL s = scale > 0 ? scale : 1;
    const REAL zero = symmetric || scale == 0 ? 0 : rint(-lo / s);
    const REAL low = symmetric ? -(REAL)levels : 0;
    for (int j = 0; j < k; j++) {
        const REAL v = clamp(rint(xi[j] / s) + zero, low, (REAL)levels);
        qi[j] = scale > 0 ? v - zero : 0;
    }
    scales[i] = scale;
}

__kernel void add_bias(ARG(REAL, y), ARG(const REAL, b), const int rows, const int cols)
{
    AT(REAL, y);
    AT(const REAL, b);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i < rows && j < cols) y[i * cols + j] += b[j];
}

/* db[j] = Σ_i dy[i, j] (with beta): one work-item per column */
__kernel void bias_grad(ARG(const REAL, dy), ARG(REAL, db), const REAL beta, const int rows, const int cols)
{
    AT(const REAL, dy);
    AT(REAL, db);
    const int j = get_global_id(0);
    if (j >= cols) return;
    ACC s = 0;
    for (int i = 0; i < rows; i++) s += dy[i * cols + j];
    db[j] = WITH_BETA(db[j], s, beta);
}

inline REAL act(const int kind, const REAL x, const REAL slope)
{
    switch (kind) {
    case SIGMOID: return x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x));
    case TANH: return tanh(x);
    case RELU: return x < 0 ? 0 : x;  /* NaN stays NaN, as in PyTorch */
    case LEAKY_RELU: return x < 0 ? slope * x : x;
    case EXPONENTIAL: return exp(x);
    case SOFTRELU: return x > 0 ? x + log1p(exp(-x)) : log1p(exp(x));
    case ELU: return x < 0 ? slope * expm1(x) : x;
    case SELU: return (REAL)SELU_SCALE * (x < 0 ? (REAL)SELU_ALPHA * expm1(x) : x);
    case SOFTSIGN: return x / (1 + fabs(x));
    case HARD_SIGMOID: return unit_clip(slope * x + (REAL)0.5);
    case GELU: return (REAL)0.5 * x * (1 + erf(x * (REAL)0.7071067811865476));
    case HARD_SWISH: return x * unit_clip(x / 6 + (REAL)0.5);
    case GELU_TANH: return (REAL)0.5 * x * (1 + tanh((REAL)GELU_TANH_C * (x + (REAL)0.044715 * x * x * x)));
    case BOUNDED_RELU: return x < 0 ? 0 : (x > slope ? slope : x);  /* NaN stays NaN */
    case SQRT: return sqrt(x);
    case RECIPROCAL: return 1 / x;
    case LOG: return log(x);
    case ABS: return fabs(x);
    case ERF: return erf(x);
    default: return x;
    }
}

/* d act / d x written in terms of the output y */
inline REAL act_grad(const int kind, const REAL y, const REAL slope)
{
    switch (kind) {
    case SIGMOID: return y * (1 - y);
    case TANH: return 1 - y * y;
    case RELU: return y > 0 ? 1 : 0;
    case LEAKY_RELU: return y > 0 ? 1 : slope;
    case EXPONENTIAL: return y;
    case SOFTRELU: return 1 - exp(-y);
    case ELU: return y > 0 ? 1 : y + slope;
    case SELU: return y > 0 ? (REAL)SELU_SCALE : y + (REAL)(SELU_SCALE * SELU_ALPHA);
    case SOFTSIGN: return (1 - fabs(y)) * (1 - fabs(y));
    case HARD_SIGMOID: return (y > 0 && y < 1) ? slope : 0;
    case BOUNDED_RELU: return (y > 0 && y < slope) ? 1 : 0;
    case SQRT: return (REAL)0.5 / y;
    case RECIPROCAL: return -y * y;
    /* y is the input x for these (INPUT_GRAD_ACTIVATIONS) */
    case GELU: return (REAL)0.5 * (1 + erf(y * (REAL)0.7071067811865476)) + y * exp((REAL)-0.5 * y * y) * (REAL)0.3989422804014327;
    case HARD_SWISH: return y < -3 ? 0 : (y > 3 ? 1 : y / 3 + (REAL)0.5);
    case LOG: return 1 / y;
    case ABS: return y > 0 ? 1 : (y < 0 ? -1 : 0);
    case ERF: return (REAL)1.1283791670955126 * exp(-y * y);
    case GELU_TANH: {
        const REAL t = tanh((REAL)GELU_TANH_C * (y + (REAL)0.044715 * y * y * y));
        return (REAL)0.5 * (1 + t) + (REAL)0.5 * y * (1 - t * t) * (REAL)GELU_TANH_C * (1 + (REAL)(3 * 0.044715) * y * y);
    }
    default: return 1;
    }
}

__kernel void activation(const int kind, ARG(const REAL, x), ARG(REAL, y), const REAL slope, const int n)
{
    AT(const REAL, x);
    AT(REAL, y);
    const int i = get_global_id(0);
    if (i < n) y[i] = act(kind, x[i], slope);
}

__kernel void activation_backward(const int kind, ARG(const REAL, y), ARG(const REAL, dy), ARG(REAL, dx),
                                  const REAL beta, const REAL slope, const int n)
{
    AT(const REAL, y);
    AT(const REAL, dy);
    AT(REAL, dx);
    const int i = get_global_id(0);
    if (i < n) dx[i] = WITH_BETA(dx[i], dy[i] * act_grad(kind, y[i], slope), beta);
}

/* row softmax (take_log: log-softmax): one work-item per row */
__kernel void softmax_rows(ARG(const REAL, x), ARG(REAL, y), const int rows, const int cols, const int take_log)
{
    AT(const REAL, x);
    AT(REAL, y);
    const int i = get_global_id(0);
    if (i >= rows) return;
    __global const REAL* xi = x + i * cols;
    __global REAL* yi = y + i * cols;
    REAL m = xi[0];
    for (int j = 1; j < cols; j++) m = fmax(m, xi[j]);
    ACC s = 0;
    for (int j = 0; j < cols; j++) { yi[j] = exp(xi[j] - m); s += yi[j]; }
    const REAL lse = m + log(s);
    for (int j = 0; j < cols; j++) yi[j] = take_log ? xi[j] - lse : yi[j] / s;
}

/* take_log (y = log-softmax): dx = dy - exp(y) Σ dy; else dx = y (dy - Σ dy y) */
__kernel void softmax_rows_backward(ARG(const REAL, y), ARG(const REAL, dy), ARG(REAL, dx), const REAL beta,
                                    const int rows, const int cols, const int take_log)
{
    AT(const REAL, y);
    AT(const REAL, dy);
    AT(REAL, dx);
    const int i = get_global_id(0);
    if (i >= rows) return;
    const int o = i * cols;
    ACC d = 0;
    for (int j = 0; j < cols; j++) d += take_log ? dy[o + j] : dy[o + j] * y[o + j];
    for (int j = 0; j < cols; j++) {
        const REAL v = take_log ? dy[o + j] - exp(y[o + j]) * d : y[o + j] * (dy[o + j] - d);
        dx[o + j] = WITH_BETA(dx[o + j], v, beta);
    }
}

/* probs = softmax(x) per row; cost[i] = -w[i] log probs[i, labels[i]] */
__kernel void softmax_cross_entropy(ARG(const REAL, x), ARG(const int, labels), ARG(const REAL, w),
                                    const int weighted, ARG(REAL, probs), ARG(REAL, cost), const int rows,
                                    const int cols)
{
    AT(const REAL, x);
    AT(const int, labels);
    AT(const REAL, w);
    AT(REAL, probs);
    AT(REAL, cost);
    const int i = get_global_id(0);
    if (i >= rows) return;
    const int o = i * cols;
    REAL m = x[o];
    for (int j = 1; j < cols; j++) m = fmax(m, x[o + j]);
    ACC s = 0;
    for (int j = 0; j < cols; j++) { probs[o + j] = exp(x[o + j] - m); s += probs[o + j]; }
    for (int j = 0; j < cols; j++) probs[o + j] = probs[o + j] / s;
    /* -log p from the logits: exact where p underflows; a label outside the classes (the host
       checks them; this guards device memory) gives NaN instead of a read out of bounds */
    const int y = labels[i];
    cost[i] = (y < 0 || y >= cols) ? NAN : (weighted ? w[i] : 1) * (m + log(s) - x[o + y]);
}

__kernel void softmax_cross_entropy_backward(ARG(const REAL, probs), ARG(const int, labels),
                                             ARG(const REAL, w), const int weighted, ARG(const REAL, dcost),
                                             ARG(REAL, dx), const REAL beta, const int rows, const int cols)
{
    AT(const REAL, probs);
    AT(const int, labels);
    AT(const REAL, w);
    AT(const REAL, dcost);
    AT(REAL, dx);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= rows || j >= cols) return;
    const REAL g = dcost[i] * (weighted ? w[i] : 1);
    const REAL v = g * (probs[i * cols + j] - (j == labels[i] ? 1 : 0));
    dx[i * cols + j] = WITH_BETA(dx[i * cols + j], v, beta);
}

/* pair costs: 0 square error Σ (x - t)², 1 binary cross-entropy of sigmoid(x) */
inline REAL pair_term(const int kind, const REAL x, const REAL t)
{
    if (kind == 0) return (x - t) * (x - t);
    return (x > 0 ? x : 0) - x * t + log1p(exp(-fabs(x)));
}

inline REAL pair_grad(const int kind, const REAL x, const REAL t, const int wrt_target)
{
    if (kind == 0) return wrt_target ? -2 * (x - t) : 2 * (x - t);
    if (wrt_target) return -x;
    return (x >= 0 ? 1 / (1 + exp(-x)) : exp(x) / (1 + exp(x))) - t;
}

__kernel void pair_cost(const int kind, ARG(const REAL, x), ARG(const REAL, t), ARG(const REAL, w),
                        const int weighted, ARG(REAL, cost), const int rows, const int cols)
{
    AT(const REAL, x);
    AT(const REAL, t);
    AT(const REAL, w);
    AT(REAL, cost);
    const int i = get_global_id(0);
    if (i >= rows) return;
    ACC s = 0;
    for (int j = 0; j < cols; j++) s += pair_term(kind, x[i * cols + j], t[i * cols + j]);
    cost[i] = (weighted ? w[i] : 1) * s;
}

__kernel void pair_cost_backward(const int kind, ARG(const REAL, x), ARG(const REAL, t), ARG(const REAL, w),
                                 const int weighted, ARG(const REAL, dcost), ARG(REAL, dout),
                                 const int wrt_target, const REAL beta, const int rows, const int cols)
{
    AT(const REAL, x);
    AT(const REAL, t);
    AT(const REAL, w);
    AT(const REAL, dcost);
    AT(REAL, dout);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= rows || j >= cols) return;
    const int o = i * cols + j;
    const REAL v = dcost[i] * (weighted ? w[i] : 1) * pair_grad(kind, x[o], t[o], wrt_target);
    dout[o] = WITH_BETA(dout[o], v, beta);
}

/* partial sums of squares: one value per work-group of 256 (the host adds them up) */
/* partial sums of x² over n values: all of x, or (by_rows) the listed rows of width values */
__kernel void sum_squares(ARG(const REAL, x), ARG(const int, rows), const int by_rows, const int width,
                          const int x_rows, ARG(REAL, partial), const int n, __local REAL* scratch)
{
    AT(const REAL, x);
    AT(const int, rows);
    AT(REAL, partial);
    const int lid = get_local_id(0), size = get_local_size(0);
    ACC s = 0;
    for (int i = get_global_id(0); i < n; i += get_global_size(0)) {
        const int r = by_rows ? rows[i / width] : 0;
        const REAL v = !by_rows ? x[i] : (r >= 0 && r < x_rows) ? x[r * width + i % width] : NAN;
        s += v * v;
    }
    scratch[lid] = s;
    barrier(CLK_LOCAL_MEM_FENCE);
    for (int stride = size / 2; stride > 0; stride /= 2) {
        if (lid < stride) scratch[lid] += scratch[lid + stride];
        barrier(CLK_LOCAL_MEM_FENCE);
    }
    if (lid == 0) partial[get_group_id(0)] = scratch[0];
}

/* ---- rows and columns */

/* The row kernels skip (or, gathering, write NaN for) an index outside the rows it addresses:
   the host checks every index it uploads, and these guards keep device-resident ones in bounds. */
__kernel void gather_rows(ARG(const REAL, src), const int src_rows, const int src_cols, ARG(const int, index),
                          ARG(REAL, dst), const int rows, const int cols, const int col)
{
    AT(const REAL, src);
    AT(const int, index);
    AT(REAL, dst);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= rows || j >= cols) return;
    const int r = index[i];
    dst[i * cols + j] = (r < 0 || r >= src_rows) ? NAN : src[r * src_cols + col + j];
}

__kernel void scatter_rows(ARG(const REAL, src), ARG(const int, index), ARG(REAL, dst), const int dst_rows,
                           const int dst_cols, const REAL beta, const int rows, const int cols, const int col)
{
    AT(const REAL, src);
    AT(const int, index);
    AT(REAL, dst);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i >= rows || j >= cols || index[i] < 0 || index[i] >= dst_rows) return;
    const int o = index[i] * dst_cols + col + j;
    dst[o] = WITH_BETA(dst[o], src[i * cols + j], beta);
}

/* dst[ids[i]] += src[i]: one work-item per column walks every row, so repeated ids never race */
__kernel void scatter_add_rows(ARG(const REAL, src), ARG(const int, ids), ARG(REAL, dst), const int dst_rows,
                               const int rows, const int cols)
{
    AT(const REAL, src);
    AT(const int, ids);
    AT(REAL, dst);
    const int j = get_global_id(0);
    if (j >= cols) return;
    for (int i = 0; i < rows; i++)
        if (ids[i] >= 0 && ids[i] < dst_rows) dst[ids[i] * cols + j] += src[i * cols + j];
}

__kernel void fill_rows(ARG(REAL, dst), ARG(const int, rows_), const REAL value, const int dst_rows, const int n,
                        const int cols)
{
    AT(REAL, dst);
    AT(const int, rows_);
    const int j = get_global_id(0), i = get_global_id(1);
    if (i < n && j < cols && rows_[i] >= 0 && rows_[i] < dst_rows) dst[rows_[i] * cols + j] = value;
}

/* dropout mask: 1/keep with probability keep, else 0, from a counter-based hash of
 * (seed, i), so no generator state lives on the device */
inline uint hash32(uint x)
{
    x ^= x >> 16; x *= 0x7feb352dU; x ^= x >> 15; x *= 0x846ca68bU; x ^= x >> 16;
    return x;
}

__kernel void bernoulli_mask(ARG(REAL, mask), const REAL keep, const uint seed, const int n)
{
    AT(REAL, mask);
    const int i = get_global_id(0);
    if (i >= n) return;
    const float u = (hash32(hash32((uint)i) ^ seed) >> 8) * (1.0f / 16777216.0f);
    mask[i] = u < keep ? 1 / keep : 0;
}

/* ---- optimizer updates (PyTorch's formulas, as the CPU kernels) */

__kernel void sgd_update(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, v), const REAL lr, const REAL momentum,
                         const REAL dampening, const int nesterov, const REAL weight_decay, const int n)
{
    AT(REAL, p);
    AT(const REAL, g);
    AT(REAL, v);
    const int i = get_global_id(0);
    if (i >= n) return;
    REAL gi = g[i] + weight_decay * p[i];
    if (momentum != 0) {
        const REAL vi = momentum * v[i] + (1 - dampening) * gi;
        v[i] = vi;
        gi = nesterov ? gi + momentum * vi : vi;
    }
    p[i] -= lr * gi;
}

__kernel void adam_update(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, m), ARG(REAL, v), const REAL lr,
                          const REAL beta1, const REAL beta2, const REAL eps, const REAL weight_decay,
                          const int decoupled, const REAL step_size, const REAL root_c2, const int n)
{
    AT(REAL, p);
    AT(const REAL, g);
    AT(REAL, m);
    AT(REAL, v);
    const int i = get_global_id(0);
    if (i >= n) return;
    REAL pi = p[i], gi = g[i];
    if (decoupled) pi *= 1 - lr * weight_decay;
    else gi += weight_decay * pi;
    const REAL mi = beta1 * m[i] + (1 - beta1) * gi;
    const REAL vi = beta2 * v[i] + (1 - beta2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - step_size * mi / (sqrt(vi) / root_c2 + eps);
}

__kernel void adagrad_update(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, s), const REAL lr, const REAL eps,
                             const REAL weight_decay, const int n)
{
    AT(REAL, p);
    AT(const REAL, g);
    AT(REAL, s);
    const int i = get_global_id(0);
    if (i >= n) return;
    const REAL gi = g[i] + weight_decay * p[i];
    const REAL si = s[i] + gi * gi;
    s[i] = si;
    p[i] -= lr * gi / (sqrt(si) + eps);
}

__kernel void rmsprop_update(ARG(REAL, p), ARG(const REAL, g), ARG(REAL, s), ARG(REAL, buf), const REAL lr,
                             const REAL alpha, const REAL eps, const REAL weight_decay, const REAL momentum,
                             const int n)
{
    AT(REAL, p);
    AT(const REAL, g);
    AT(REAL, s);
    AT(REAL, buf);
    const int i = get_global_id(0);
    if (i >= n) return;
    const REAL gi = g[i] + weight_decay * p[i];
    const REAL si = alpha * s[i] + (1 - alpha) * gi * gi;
    s[i] = si;
    const REAL step = gi / (sqrt(si) + eps);
    if (momentum != 0) {
        const REAL b = momentum * buf[i] + step;
        buf[i] = b;
        p[i] -= lr * b;
    } else {
        p[i] -= lr * step;
    }
}
