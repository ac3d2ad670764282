/* 0 where v < 0, v elsewhere */
static inline __attribute__((always_inline)) VEC SUFFIXED(relu)(VEC v) {
    IVEC negative = (IVEC)(v < 0);
    return (VEC)((IVEC)v & ~negative);
}
