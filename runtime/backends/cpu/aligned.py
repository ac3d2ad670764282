"""Arrays that start on a cache line, for the CPU kernels' operands and scratch.

numpy aligns its allocations to 16 bytes only, so a 32-byte vector of the kernels crossed a cache
line at every other load or store, as chance had it: a convolution's time then depended on what
had been allocated before it. Every array the CPU backend allocates for its kernels, and every packed
weight they stream, is made here.
"""
import math

import numpy as np

CACHE_LINE = 64


def aligned_empty(shape, dtype, align=CACHE_LINE):
    """np.empty(shape, dtype) whose data starts at a multiple of `align` bytes."""
    dtype = np.dtype(dtype)
    shape = (int(shape),) if np.ndim(shape) == 0 else tuple(map(int, shape))
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start:start + nbytes].view(dtype).reshape(shape)


def aligned_copy(a, dtype=None):
    """A C-contiguous copy of `a` (as `dtype`) that starts on a cache line."""
    out = aligned_empty(np.shape(a), dtype or np.asarray(a).dtype)
    out[...] = a
    return out
