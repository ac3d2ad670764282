"""The one place that sets how many threads lamina uses: OpenMP (the Cython kernels and MKL's GNU
threading layer share gcc's libgomp) and OpenBLAS's own pool.

`LAMINA_THREADS` sets the starting value; `set_num_threads` changes it at run time.
`split_work` runs independent pieces of one layer (the samples of a convolution) on the threads
instead, each with single-threaded kernels and BLAS.
"""
import os
import threading
from concurrent.futures import ThreadPoolExecutor

from . import _kernels, _mkl, _openblas

_current = None


class SettingError(ValueError):
    """A setting that is not valid: a thread count that is not a positive integer (LAMINA_THREADS,
    set_num_threads), or an unknown LAMINA_BLAS."""


def _default_threads():
    env = os.environ.get("LAMINA_THREADS")
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            raise SettingError(f"LAMINA_THREADS: expected a positive integer, found {env!r}") from None
        if n < 1:
            raise SettingError(f"LAMINA_THREADS: expected a positive integer, found {n}")
        return n
    return len(os.sched_getaffinity(0))


def set_num_threads(n):
    """Use n threads in every kernel and in both BLAS providers."""
    global _current
    n = int(n)
    if n < 1:
        raise SettingError(f"set_num_threads: expected a positive integer, found {n}")
    _kernels.set_num_threads(n)
    _mkl.set_num_threads(n)
    _openblas.set_num_threads(n)
    _current = n


def get_num_threads():
    return _current


_pool, _pool_size = None, 0
_split_lock = threading.Lock()


def split_work(count, work, threads=None):
    """work(t, items) for t < T, where the T runs `items` cover range(count) in order and each
    is non-empty, T = min(threads or lamina's thread count, count); returns T. With T > 1 the
    calling thread takes run 0 and each other run gets a worker thread; every run's kernels and
    BLAS calls are single-threaded (the kernels release the GIL), so the pieces run side by side
    with no team to wake inside them; BLAS returns to the full thread count afterwards. The
    first exception raised by a run is re-raised here, after every run has finished.
    (The caller works instead of waiting: one thread to wake fewer, and its core stays busy. On
    this project's 2-core virtual machine, waking both halves of a convolution from a pool
    after an idle spell made the next calls of the CNN bench about 2x slower.)"""
    global _pool, _pool_size
    count = int(count)
    threads = min(threads or _current, count)
    if threads <= 1:
        if count:
            work(0, range(count))
        return max(threads, 0)
    with _split_lock:  # one split at a time: BLAS thread counts are process-wide
        if _pool is None or _pool_size < threads - 1:  # grow: the old workers are let go
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool, _pool_size = ThreadPoolExecutor(threads - 1, thread_name_prefix="lamina"), threads - 1

        def run(t):
            _kernels.set_num_threads(1)  # OpenMP's thread count is per calling thread
            work(t, range(t * count // threads, (t + 1) * count // threads))

        _mkl.set_num_threads(1)
        _openblas.set_num_threads(1)
        mine = _kernels.get_num_threads()
        errors = [None]
        try:
            futures = [_pool.submit(run, t) for t in range(1, threads)]
            try:
                run(0)
            except BaseException as e:  # kept until the other runs have finished
                errors[0] = e
            errors += [f.exception() for f in futures]
        finally:
            _kernels.set_num_threads(mine)
            _mkl.set_num_threads(_current)
            _openblas.set_num_threads(_current)
        for e in errors:
            if e is not None:
                raise e
    return threads


# A bad LAMINA_THREADS must not make `import lamina` fail (the `lamina` command could not even
# report it): the error is kept and raised by the first Network made (check_environment), and the
# command reports it in one line.
ENV_ERROR = None
try:
    _start = _default_threads()
except SettingError as _e:
    ENV_ERROR, _start = _e, len(os.sched_getaffinity(0))
set_num_threads(_start)


def check_environment():
    """Raise the error of a bad LAMINA_THREADS or LAMINA_BLAS, if there is one."""
    if ENV_ERROR is not None:
        raise ENV_ERROR
    from .backends.blas import default_provider
    try:
        default_provider()
    except ValueError as e:
        raise SettingError(str(e)) from None
