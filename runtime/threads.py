"""The one place that sets how many threads lamina uses: OpenMP (the Cython kernels and MKL's GNU
threading layer share gcc's libgomp) and OpenBLAS's own pool.

`LAMINA_THREADS` sets the starting value; `set_num_threads` changes it at run time.
"""
import os

from . import _kernels, _mkl, _openblas

_current = None


def _default_threads():
    env = os.environ.get("LAMINA_THREADS")
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"LAMINA_THREADS: expected a positive integer, found {env!r}") from None
        if n < 1:
            raise ValueError(f"LAMINA_THREADS: expected a positive integer, found {n}")
        return n
    return len(os.sched_getaffinity(0))


def set_num_threads(n):
    """Use n threads in every kernel and in both BLAS providers."""
    global _current
    n = int(n)
    if n < 1:
        raise ValueError(f"set_num_threads: expected a positive integer, found {n}")
    _kernels.set_num_threads(n)
    _mkl.set_num_threads(n)
    _openblas.set_num_threads(n)
    _current = n


def get_num_threads():
    return _current


set_num_threads(_default_threads())
