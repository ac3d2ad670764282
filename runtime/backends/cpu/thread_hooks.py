"""The CPU backend's thread controls, registered with lamina.threads: OpenMP (the Cython kernels
and MKL's GNU threading layer share gcc's libgomp), MKL, and OpenBLAS.

OpenBLAS always runs on one thread: its own pool is never used. Its calling thread waits for the
pool's workers by spinning, and where the OS put a woken worker on the caller's core (it does on
a small virtual machine after an idle spell), the worker waited for a whole time slice.
lamina.threads.split_work splits GEMMs instead, and its waits sleep, so a shared core passes to
the other thread at once.
"""
from ...threads import ThreadHooks
from .compiled import _kernels
from .blas import mkl, provider


class CPUThreadHooks(ThreadHooks):
    def __init__(self):
        self.openblas = provider("openblas")
        self.mkl = mkl()  # None where lamina was built without MKL

    def _set_mkl_threads(self, n):
        if self.mkl is not None:
            self.mkl.set_num_threads(n)

    def set_num_threads(self, n):
        _kernels.set_num_threads(n)
        self._set_mkl_threads(n)
        self.openblas.set_num_threads(1)

    def enter_split(self):
        self._set_mkl_threads(1)
        _kernels.team_rest()  # (the compiled team's workers would spin on the pieces' CPUs)
        return _kernels.get_num_threads()

    def enter_piece(self):
        _kernels.set_num_threads(1)  # OpenMP's thread count is per calling thread

    def leave_split(self, saved, n):
        _kernels.set_num_threads(saved)
        self._set_mkl_threads(n)

    def current_cpu(self):
        return _kernels.current_cpu()

    def count_up(self, counter):
        _kernels.count_up(counter)

    def wait_for(self, counter, n, spin_seconds):
        _kernels.spin_until(counter, n, spin_seconds)
