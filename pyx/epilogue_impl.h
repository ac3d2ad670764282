/* 0 where v < 0, v elsewhere */
static inline __attribute__((always_inline)) VEC SUFFIXED(relu)(VEC v) {
    IVEC negative = (IVEC)(v < 0);
    return (VEC)((IVEC)v & ~negative);
}

/* The larger of each lane of a and b, a where they tie or b is NaN (a max pool's "only a greater
 * value replaces"). */
static inline __attribute__((always_inline)) VEC SUFFIXED(pool_max)(VEC a, VEC b) {
    IVEC greater = (IVEC)(b > a);
    return (VEC)(((IVEC)b & greater) | ((IVEC)a & ~greater));
}
