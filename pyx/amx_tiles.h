/* AMX tiles for the panel products (dot_panels.h): whether this process may use them, and their
 * shapes. An AMX tile is a register of up to 16 rows of 64 bytes; one tile instruction adds to a
 * tile of 16 x 16 sums (float32 or int32) the products of a tile of 16 rows of the left operand
 * (each 16 groups of 32 bits: pairs of bfloat16, quads of u8) and a tile of 16 groups of 16
 * channels (each row 64 bytes: one group of every channel). The panels hold exactly that: a panel's
 * 16 groups in a row are 1 KiB, a tile, and a row of the left operand is a run of groups, so a tile
 * of u is 16 rows of 64 bytes, ldu bytes apart. Every tile here is 64 bytes wide: the depth is
 * padded to whole tiles (lamina_dot_groups); the rows short of a whole tile are one tile of fewer
 * rows (the tiles reconfigured).
 *
 * Linux hands a process the tiles' state only once asked (arch_prctl ARCH_REQ_XCOMP_PERM, Linux
 * 5.16 and later); the permission holds for every thread of the process. */
#ifndef LAMINA_AMX_TILES_H
#define LAMINA_AMX_TILES_H

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && defined(LAMINA_TARGET_V4)
#define LAMINA_AMX 1
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

/* 1 where this process multiplies the panels on AMX tiles (lamina_amx_enable: set once, when the
 * module is chosen, before any panel is packed), else 0. */
static int lamina_amx_on;

/* Turns the tiles on where this module, the CPU (AMX-TILE, AMX-BF16 and AMX-INT8, with the
 * AVX-512 sets the AMX kernels' stores and the vector kernels beside them are compiled for) and the
 * OS allow: 1 if on. */
static int lamina_amx_enable(void) {
#ifdef LAMINA_AMX
    unsigned a, b, c, d;
    const unsigned amx = 1u << 22 | 1u << 24 | 1u << 25;  /* CPUID.7.0:EDX AMX-BF16, AMX-TILE, AMX-INT8 */
    if (lamina_amx_on)
        return 1;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || (d & amx) != amx)
        return 0;
    if (!__builtin_cpu_supports("avx512bf16") || !__builtin_cpu_supports("avx512vnni") ||
        !__builtin_cpu_supports("avx512vl"))
        return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & 1u << 27))  /* OSXSAVE: XGETBV reads XCR0 */
        return 0;
    unsigned lo, hi;
    __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    if ((lo & 3u << 17) != 3u << 17)  /* the OS saves the tiles' configuration and data */
        return 0;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0)
        return 0;
    lamina_amx_on = 1;
    return 1;
#else
    return 0;
#endif
}

/* The rows of u a pass of the panels multiplies (amx_panel_impl.h): bytes of them, at least 32
 * rows. With a pair of panels' tiles they stay in L1: against 32 KiB, on an Intel Xeon with AMX,
 * 2 threads, 1920 x 256 x 1024 in int8 0.61-0.62 ms against 0.80-0.81, in bfloat16 0.75-0.77
 * against 0.86-0.89; 256 x 1024 x 1024 and 64 x 256 x 1024 the same or faster. */
#define AMX_BLOCK_BYTES (16 * 1024)

#ifdef LAMINA_AMX
/* The tiles' configuration (palette 1): every tile rows of 64 bytes, 16 of them but in the tiles
 * of sums and of the left operand's rows (tmm0-5: `rows`, 1 to 16). */
typedef struct __attribute__((aligned(64))) {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} lamina_amx_config;

/* Configures the calling thread's tiles (ldtilecfg reads the whole 64 bytes). */
static inline void lamina_amx_begin(long rows) {
    lamina_amx_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 6 ? (uint8_t)rows : 16;
    }
    __asm__ volatile("ldtilecfg %0" ::"m"(cfg));
}

/* Returns the calling thread's tiles to their initial state (no tile state to save on a switch). */
static inline void lamina_amx_end(void) { __asm__ volatile("tilerelease" ::); }
#endif

#endif
