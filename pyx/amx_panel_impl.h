/* The panel product on AMX tiles (amx_tiles.h), once per number format, with dot_panel_impl.h's
 * macros for the format (DOT_ACC, DOT_OUT, DOT_STORE) and:
 * AMX_KERNEL(name) names its functions, AMX_TARGET is their target (the store's), AMX_DOT(c, a, b)
 * the tile instruction (tile numbers: c += a · b) and AMX_SUM the type of a sum (float, int32_t).
 *
 * Tiles: tmm0-3 the sums (row tile r and panel c in tmm 2r + c), tmm4-5 two row tiles of u, tmm6-7
 * two panels' tiles; each step of 16 groups loads up to four tiles and runs up to four products. */

/* The first `rows` rows of a tile's 16 x 16 sums (row-major in `sums`) stored as rows row.. and
 * channels col.. by the format's DOT_STORE; where the format defines AMX_STORE_TRANSPOSED, an
 * output stored transposed goes through it, the whole tile at once. (A store of a row in one
 * AVX-512 vector measured no faster in bfloat16 and 1.7x slower in int8, its vpmulld on 512 bits:
 * 1920 x 256 x 1024 on an Intel Xeon with AMX, 2 threads, 0.61-0.64 ms against 1.02-1.08.) */
static inline __attribute__((always_inline, target(AMX_TARGET))) void
AMX_KERNEL(store)(const DOT_OUT *o, const AMX_SUM *sums, long rows, long row, long col, long n) {
    const long nr = n - col < DOT_NR ? n - col : DOT_NR;
#ifdef AMX_STORE_TRANSPOSED
    if (o->transposed) {
        AMX_STORE_TRANSPOSED(o, sums, rows, row, col, nr);
        return;
    }
#endif
    for (long i = 0; i < rows; i++) {
        DOT_ACC acc[2];
        memcpy(acc, sums + 16 * i, sizeof acc);
        DOT_STORE(o, row + i, col, nr, acc);
    }
}

/* R x C tiles (R, C: 1 or 2, constants where inlined): rows row.. of u (R tiles of the
 * configured rows: `rows` of them stored) times panels b.. (C of them, panel_bytes apart),
 * `steps` tiles deep. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void
AMX_KERNEL(tiles)(const int R, const int C, long steps, const uint8_t *u, long ldu, const char *b, long panel_bytes,
                  const DOT_OUT *o, long rows, long row, long col, long n) {
    AMX_SUM sums[16 * 16] __attribute__((aligned(64)));
    _tile_zero(0);
    if (C == 2)
        _tile_zero(1);
    if (R == 2)
        _tile_zero(2);
    if (R == 2 && C == 2)
        _tile_zero(3);
    for (long s = 0; s < steps; s++) {
        _tile_loadd(4, u + 64 * s, ldu);
        _tile_loadd(6, b + 1024 * s, 64);
        AMX_DOT(0, 4, 6);
        if (C == 2) {
            _tile_loadd(7, b + panel_bytes + 1024 * s, 64);
            AMX_DOT(1, 4, 7);
        }
        if (R == 2) {
            _tile_loadd(5, u + 16 * ldu + 64 * s, ldu);
            AMX_DOT(2, 5, 6);
        }
        if (R == 2 && C == 2)
            AMX_DOT(3, 5, 7);
    }
    _tile_stored(0, sums, 64);
    AMX_KERNEL(store)(o, sums, rows, row, col, n);
    if (C == 2) {
        _tile_stored(1, sums, 64);
        AMX_KERNEL(store)(o, sums, rows, row, col + DOT_NR, n);
    }
    if (R == 2) {
        _tile_stored(2, sums, 64);
        AMX_KERNEL(store)(o, sums, rows, row + 16, col, n);
    }
    if (R == 2 && C == 2) {
        _tile_stored(3, sums, 64);
        AMX_KERNEL(store)(o, sums, rows, row + 16, col + DOT_NR, n);
    }
}

/* Every panel of [p0, p1) times one tile of rows (row.. of u, as many as configured, `rows` of
 * them stored), in pairs of panels. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void
AMX_KERNEL(row_tile)(long steps, const uint8_t *u, long ldu, const void *packed, long panel_bytes, long p0, long p1,
                     const DOT_OUT *o, long rows, long row, long n) {
    long p = p0;
    for (; p + 1 < p1; p += 2)
        AMX_KERNEL(tiles)(1, 2, steps, u, ldu, (const char *)packed + p * panel_bytes, panel_bytes, o, rows, row,
                          p * DOT_NR, n);
    if (p < p1)
        AMX_KERNEL(tiles)(1, 1, steps, u, ldu, (const char *)packed + p * panel_bytes, panel_bytes, o, rows, row,
                          p * DOT_NR, n);
}

/* Rows [i0, i1) of u times panels [p0, p1) of a product of n channels, `groups` (whole tiles)
 * deep: the whole tiles of rows in blocks of AMX_BLOCK_BYTES of u that pairs of panels pass
 * over, two row tiles at a time; then the rows short of a tile as one tile of fewer rows. */
static __attribute__((target(AMX_TARGET))) void AMX_KERNEL(gemm)(long i0, long i1, long groups, long n,
                                                                 const uint8_t *u, long ldu, const void *packed,
                                                                 long p0, long p1, const DOT_OUT *o) {
    const long whole = i0 + (i1 - i0) / 16 * 16;
    const long panel_bytes = groups * DOT_NR * 4, steps = groups / DOT_TILE_GROUPS;
    if (whole > i0) {
        long block = AMX_BLOCK_BYTES / (groups * 4) / 32 * 32;
        block = block < 32 ? 32 : block;
        lamina_amx_begin(16);
        for (long r0 = i0; r0 < whole; r0 += block) {
            const long r1 = whole - r0 < block ? whole : r0 + block;
            for (long p = p0; p < p1; p += 2) {
                const char *b = (const char *)packed + p * panel_bytes;
                const long col = p * DOT_NR;
                long r = r0;
                if (p + 1 < p1)
                    for (; r + 32 <= r1; r += 32)
                        AMX_KERNEL(tiles)(2, 2, steps, u + r * ldu, ldu, b, panel_bytes, o, 16, r, col, n);
                else
                    for (; r + 32 <= r1; r += 32)
                        AMX_KERNEL(tiles)(2, 1, steps, u + r * ldu, ldu, b, panel_bytes, o, 16, r, col, n);
                if (r < r1)
                    AMX_KERNEL(row_tile)(steps, u + r * ldu, ldu, packed, panel_bytes, p, p + 1 < p1 ? p + 2 : p + 1,
                                         o, 16, r, n);
            }
        }
    }
    if (whole < i1) {
        lamina_amx_begin(i1 - whole);
        AMX_KERNEL(row_tile)(steps, u + whole * ldu, ldu, packed, panel_bytes, p0, p1, o, i1 - whole, whole, n);
    }
    if (i0 < i1)
        lamina_amx_end();
}
