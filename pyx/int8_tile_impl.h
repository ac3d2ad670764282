/* The int8 panels' vector kernel (int8_panels.h), once per instruction set: INT8_KERNEL(name)
 * names its functions, INT8_TARGET is their target, INT8_ROWS the rows of its widest tile (two
 * int32 sums of 8 channels a row in registers), INT8_DOT(acc, x, b, ones) adds to each int32
 * lane of acc the four u8 x s8 products of its quad (x: a row's 4 bytes in every lane; b: a
 * panel's 4 depths of 8 channels). Both instruction sets compute the same integers. */
/* The tile: ROWS (INT8_ROWS, 4, 2 or 1: a constant where inlined) rows of a times one panel. */
static inline __attribute__((always_inline, target(INT8_TARGET))) void
INT8_KERNEL(tile)(const long ROWS, long quads, const uint8_t *u, long ldu, const int8_t *panel,
                      const lamina_int8_out *o, long i0, long col, long nr) {
    const __m256i ones = _mm256_set1_epi16(1);
    (void)ones;
    __m256i lo[INT8_ROWS], hi[INT8_ROWS];
    for (long i = 0; i < ROWS; i++) {
        lo[i] = _mm256_setzero_si256();
        hi[i] = _mm256_setzero_si256();
    }
    for (long kq = 0; kq < quads; kq++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(panel + kq * 64));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(panel + kq * 64 + 32));
        for (long i = 0; i < ROWS; i++) {
            int32_t quad;
            memcpy(&quad, u + i * ldu + 4 * kq, 4);
            const __m256i x = _mm256_set1_epi32(quad);
            lo[i] = INT8_DOT(lo[i], x, b0, ones);
            hi[i] = INT8_DOT(hi[i], x, b1, ones);
        }
    }
    for (long i = 0; i < ROWS; i++) {
        const long r = i0 + i;
        float *c = o->c + r * o->ldc + col;
        if (nr < INT8_NR) {
            int32_t sums[INT8_NR];
            _mm256_storeu_si256((__m256i *)sums, lo[i]);
            _mm256_storeu_si256((__m256i *)(sums + 8), hi[i]);
            lamina_int8_store_row(o, r, col, nr, sums);
            continue;
        }
        const __m256i zero = _mm256_set1_epi32(o->zero[r]);
        const __m256 rs = _mm256_set1_ps(o->row_scale[r]);
        __m256i acc[2] = {lo[i], hi[i]};
        for (int h = 0; h < 2; h++) {
            const long j = col + 8 * h;
            const __m256i sums = _mm256_loadu_si256((const __m256i *)(o->col_sum + j));
            const __m256 diff = _mm256_cvtepi32_ps(_mm256_sub_epi32(acc[h], _mm256_mullo_epi32(zero, sums)));
            __m256 v = _mm256_mul_ps(_mm256_mul_ps(rs, _mm256_loadu_ps(o->col_scale + j)), diff);
            if (o->bias)
                v = _mm256_add_ps(v, _mm256_loadu_ps(o->bias + j));
            else if (o->beta != 0.0f)
                v = _mm256_add_ps(v, _mm256_mul_ps(_mm256_set1_ps(o->beta), _mm256_loadu_ps(c + 8 * h)));
            _mm256_storeu_ps(c + 8 * h, v);
        }
    }
}

static __attribute__((target(INT8_TARGET))) void INT8_KERNEL(panel)(long m, long quads, const uint8_t *u, long ldu,
                                                                    const int8_t *panel, const lamina_int8_out *o,
                                                                    long i0, long col, long nr) {
    long i = 0;
    for (; i + INT8_ROWS <= m; i += INT8_ROWS)
        INT8_KERNEL(tile)(INT8_ROWS, quads, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
    if (INT8_ROWS > 4 && m - i >= 4) {
        INT8_KERNEL(tile)(4, quads, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
        i += 4;
    }
    if (m - i >= 2) {
        INT8_KERNEL(tile)(2, quads, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
        i += 2;
    }
    if (i < m)
        INT8_KERNEL(tile)(1, quads, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
}
