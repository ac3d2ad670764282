/* float32 to bfloat16 (round to nearest, ties to even; a NaN stays a quiet NaN), over a whole
 * array: integer operations only, so gcc vectorises the loop (8 lanes in the AVX2 clone). */
#ifndef LAMINA_CONVERT_H
#define LAMINA_CONVERT_H
#include <stdint.h>
#include <string.h>
#include "clones.h"

/* the bfloat16 bits of the float32 bits u */
static inline uint16_t lamina_bf16_bits(uint32_t u) {
    uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    uint32_t nan = ((u >> 16) | 0x40u) & 0xffffu;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? nan : rounded);
}

LAMINA_CLONES static void lamina_to_bfloat16(const float *restrict x, uint16_t *restrict out, long n) {
    for (long i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, &x[i], 4);
        out[i] = lamina_bf16_bits(u);
    }
}

/* x rounded to its nearest bfloat16 value, as float32 (out may be x) */
static inline float lamina_round_bfloat16(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    u = (uint32_t)lamina_bf16_bits(u) << 16;
    memcpy(&x, &u, 4);
    return x;
}

#endif
