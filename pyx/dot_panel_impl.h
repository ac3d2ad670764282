/* A vector kernel of panels of 16 output channels whose depths go in groups of 32 bits (dot_panels.h;
 * int8_panels.h: quads of u8 x s8; bf16_panels.h: pairs of bfloat16), once per number format and
 * instruction set:
 * DOT_KERNEL(name) names its functions, DOT_TARGET is their target, DOT_ROWS the rows of its widest
 * tile (two accumulators of 8 channels a row in registers), DOT_ACC the accumulators' vector type
 * and DOT_ZERO() a zero one. DOT(acc, x, b) adds to each lane of acc the products of its group (x: a
 * row's group in every lane; b: a panel's group of 8 channels, both as __m256i), and
 * DOT_STORE(o, r, col, nr, acc) stores row r of the tile from its two accumulators (channels col to
 * col + nr; o a DOT_OUT). A panel is `groups` runs of 64 bytes (a group of each of its 16 channels);
 * a row of the left operand (u, rows ldu bytes apart) is `groups` runs of 4 bytes. */
/* The tile: ROWS (DOT_ROWS, 4, 2 or 1: a constant where inlined) rows of u times one panel. */
static inline __attribute__((always_inline, target(DOT_TARGET))) void
DOT_KERNEL(tile)(const long ROWS, long groups, const uint8_t *u, long ldu, const void *panel, const DOT_OUT *o,
                 long i0, long col, long nr) {
    const char *p = panel;
    DOT_ACC acc[DOT_ROWS][2];
    for (long i = 0; i < ROWS; i++)
        acc[i][0] = acc[i][1] = DOT_ZERO();
    for (long g = 0; g < groups; g++) {
        const __m256i b0 = _mm256_loadu_si256((const __m256i *)(p + g * 64));
        const __m256i b1 = _mm256_loadu_si256((const __m256i *)(p + g * 64 + 32));
        for (long i = 0; i < ROWS; i++) {
            int32_t group;
            memcpy(&group, u + i * ldu + 4 * g, 4);
            const __m256i x = _mm256_set1_epi32(group);
            acc[i][0] = DOT(acc[i][0], x, b0);
            acc[i][1] = DOT(acc[i][1], x, b1);
        }
    }
    for (long i = 0; i < ROWS; i++)
        DOT_STORE(o, i0 + i, col, nr, acc[i]);
}

/* Rows [0, m) of u times one panel, in tiles of DOT_ROWS rows and the smaller ones for the rest
 * (a lamina_dot_panel_fn: out is a DOT_OUT). */
static __attribute__((target(DOT_TARGET))) void DOT_KERNEL(panel)(long m, long groups, const uint8_t *u, long ldu,
                                                                  const void *panel, const void *out, long i0,
                                                                  long col, long nr) {
    const DOT_OUT *o = out;
    long i = 0;
    for (; i + DOT_ROWS <= m; i += DOT_ROWS)
        DOT_KERNEL(tile)(DOT_ROWS, groups, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
    if (DOT_ROWS > 4 && m - i >= 4) {
        DOT_KERNEL(tile)(4, groups, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
        i += 4;
    }
    if (m - i >= 2) {
        DOT_KERNEL(tile)(2, groups, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
        i += 2;
    }
    if (i < m)
        DOT_KERNEL(tile)(1, groups, u + i * ldu, ldu, panel, o, i0 + i, col, nr);
}
