/* Row primitives for the selective kernels: dot products and axpys over contiguous rows.
 * `omp simd` with a reduction lets gcc vectorise the float sum (a plain loop keeps the
 * sequential order and stays scalar without -ffast-math). */
#ifndef LAMINA_ROWS_H
#define LAMINA_ROWS_H

static inline float lamina_dot_f(const float* a, const float* b, long n) {
    float s = 0.0f;
    #pragma omp simd reduction(+:s)
    for (long j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

static inline double lamina_dot_d(const double* a, const double* b, long n) {
    double s = 0.0;
    #pragma omp simd reduction(+:s)
    for (long j = 0; j < n; j++) s += a[j] * b[j];
    return s;
}

/* y = alpha x + beta y; beta == 0 never reads y */
static inline void lamina_axpby_f(float alpha, const float* x, float beta, float* y, long n) {
    if (beta == 0.0f) {
        #pragma omp simd
        for (long j = 0; j < n; j++) y[j] = alpha * x[j];
    } else {
        #pragma omp simd
        for (long j = 0; j < n; j++) y[j] = alpha * x[j] + beta * y[j];
    }
}

static inline void lamina_axpby_d(double alpha, const double* x, double beta, double* y, long n) {
    if (beta == 0.0) {
        #pragma omp simd
        for (long j = 0; j < n; j++) y[j] = alpha * x[j];
    } else {
        #pragma omp simd
        for (long j = 0; j < n; j++) y[j] = alpha * x[j] + beta * y[j];
    }
}

#endif
