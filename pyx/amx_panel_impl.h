/* The panel product on AMX tiles (amx_tiles.h), once per number format, with dot_panel_impl.h's
 * macros for the format (DOT_ACC, DOT_OUT, DOT_STORE) and:
 * AMX_KERNEL(name) names its functions, AMX_TARGET is their target (the store's), AMX_DOT(c, a, b)
 * the tile instruction (tile numbers: c += a · b), AMX_SUM the type of a sum (float, int32_t) and
 * AMX_REST the vector panel kernel (a lamina_dot_panel_fn) for the rows short of a whole tile.
 *
 * Tiles: tmm0-3 the sums (row tile r and panel c in tmm 2r + c), tmm4-5 two row tiles of u, tmm6-7
 * two panels' tiles; each step of 16 groups loads up to four tiles and runs up to four products. */

/* The 16 x 16 sums of a tile (row-major in `sums`) stored as rows row.. and channels col.. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void
AMX_KERNEL(store)(const DOT_OUT *o, const AMX_SUM *sums, long row, long col, long n) {
    const long nr = n - col < DOT_NR ? n - col : DOT_NR;
    for (long i = 0; i < 16; i++) {
        DOT_ACC acc[2];
        memcpy(acc, sums + 16 * i, sizeof acc);
        DOT_STORE(o, row + i, col, nr, acc);
    }
}

/* R x C tiles (R, C: 1 or 2, constants where inlined): rows row.. of u (16 R of them) times
 * panels b.. (C of them, panel_bytes apart), `steps` tiles deep. */
static inline __attribute__((always_inline, target(AMX_TARGET))) void
AMX_KERNEL(tiles)(const int R, const int C, long steps, const uint8_t *u, long ldu, const char *b, long panel_bytes,
                  const DOT_OUT *o, long row, long col, long n) {
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
    AMX_KERNEL(store)(o, sums, row, col, n);
    if (C == 2) {
        _tile_stored(1, sums, 64);
        AMX_KERNEL(store)(o, sums, row, col + DOT_NR, n);
    }
    if (R == 2) {
        _tile_stored(2, sums, 64);
        AMX_KERNEL(store)(o, sums, row + 16, col, n);
    }
    if (R == 2 && C == 2) {
        _tile_stored(3, sums, 64);
        AMX_KERNEL(store)(o, sums, row + 16, col + DOT_NR, n);
    }
}

/* Rows [i0, i1) of u times panels [p0, p1) of a product of n channels, `groups` (whole tiles)
 * deep: the whole tiles of rows on AMX, in blocks of AMX_BLOCK_BYTES of u that pairs of panels
 * pass over, two row tiles at a time; the rest of the rows by AMX_REST. */
static __attribute__((target(AMX_TARGET))) void AMX_KERNEL(gemm)(long i0, long i1, long groups, long n,
                                                                 const uint8_t *u, long ldu, const void *packed,
                                                                 long p0, long p1, const DOT_OUT *o) {
    const long whole = i0 + (i1 - i0) / 16 * 16;
    if (whole > i0) {
        const long panel_bytes = groups * DOT_NR * 4, steps = groups / DOT_TILE_GROUPS;
        long block = AMX_BLOCK_BYTES / (groups * 4) / 32 * 32;
        block = block < 32 ? 32 : block;
        lamina_amx_begin();
        for (long r0 = i0; r0 < whole; r0 += block) {
            const long r1 = whole - r0 < block ? whole : r0 + block;
            for (long p = p0; p < p1; p += 2) {
                const char *b = (const char *)packed + p * panel_bytes;
                const long col = p * DOT_NR;
                long r = r0;
                if (p + 1 < p1) {
                    for (; r + 32 <= r1; r += 32)
                        AMX_KERNEL(tiles)(2, 2, steps, u + r * ldu, ldu, b, panel_bytes, o, r, col, n);
                    if (r < r1)
                        AMX_KERNEL(tiles)(1, 2, steps, u + r * ldu, ldu, b, panel_bytes, o, r, col, n);
                } else {
                    for (; r + 32 <= r1; r += 32)
                        AMX_KERNEL(tiles)(2, 1, steps, u + r * ldu, ldu, b, panel_bytes, o, r, col, n);
                    if (r < r1)
                        AMX_KERNEL(tiles)(1, 1, steps, u + r * ldu, ldu, b, panel_bytes, o, r, col, n);
                }
            }
        }
        lamina_amx_end();
    }
    if (whole < i1)
        lamina_dot_gemm(AMX_REST, whole, i1, groups, n, u, ldu, packed, p0, p1, o);
}
