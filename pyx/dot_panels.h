/* What the int8 panels (int8_panels.h) and the bfloat16 panels (bf16_panels.h) share: panels of 16
 * output channels whose depths go in groups of 32 bits (quads of bytes; pairs of bfloat16), 64
 * bytes a group of a panel, and the left operand's rows as runs of those groups (u, rows ldu bytes
 * apart). dot_panel_impl.h is their vector kernel. */
#ifndef LAMINA_DOT_PANELS_H
#define LAMINA_DOT_PANELS_H

#include <stdint.h>

#include "amx_tiles.h"

#define DOT_NR 16

/* The groups of a row of the left operand, and of a panel: the depth's groups, zero-padded where
 * AMX runs to whole tile rows (16 groups, 64 bytes), the depth one tile multiplies. */
#define DOT_TILE_GROUPS 16
static inline long lamina_dot_groups(long groups) {
    return lamina_amx_on ? (groups + DOT_TILE_GROUPS - 1) / DOT_TILE_GROUPS * DOT_TILE_GROUPS : groups;
}

/* The rows a team's member takes at a time when sharing a product by rows: an AMX tile's 16 where
 * AMX runs, else the vector kernel's widest tile (`vector_rows`). */
static inline long lamina_dot_tile_rows(long vector_rows) { return lamina_amx_on ? 16 : vector_rows; }

/* A panel kernel: rows [0, m) of u times one panel of `groups` groups, stored through `out` (the
 * number format's own output description) as rows i0.. and channels col to col + nr. */
typedef void (*lamina_dot_panel_fn)(long m, long groups, const uint8_t *u, long ldu, const void *panel,
                                    const void *out, long i0, long col, long nr);

/* Rows [i0, i1) of u times panels [p0, p1) of a product of n channels, by `panel`: the rows in
 * blocks of DOT_BLOCK_BYTES (at least 12 rows), the panels passing over each. Small blocks write c
 * a few whole rows at a time while the panels stream from L2 (or L3): against blocks of 128 KiB,
 * alternating in one process on an AMD Zen 4, bfloat16 1.11-1.17x on 1878 x 256 x 4096 and
 * 1920 x 256 x 1024, int8 1.07-1.09x on the first; the same (0.96-1.06x) on 256 x 1024 x 1024,
 * 64 x 256 x 1024 and 1878 x 128 x 1024, on 1 and 2 threads. */
#define DOT_BLOCK_BYTES (12 * 1024)
static void lamina_dot_gemm(lamina_dot_panel_fn panel, long i0, long i1, long groups, long n, const uint8_t *u,
                            long ldu, const void *packed, long p0, long p1, const void *out) {
    const long panel_bytes = groups * DOT_NR * 4;
    long block = DOT_BLOCK_BYTES / (groups * 4) / 12 * 12;  /* (whole tiles of 4 and of 6 rows) */
    block = block < 12 ? 12 : block;
    for (long r0 = i0; r0 < i1; r0 += block) {
        const long r1 = i1 - r0 < block ? i1 : r0 + block;
        for (long p = p0; p < p1; p++) {
            const long col = p * DOT_NR, nr = n - col < DOT_NR ? n - col : DOT_NR;
            panel(r1 - r0, groups, u + r0 * ldu, ldu, (const char *)packed + p * panel_bytes, out, r0, col, nr);
        }
    }
}

#endif
