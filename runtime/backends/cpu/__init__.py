"""The CPU backend (backend.py), its compiled kernels (_kernels, _selective, and the GEMM providers
_mkl and _openblas behind blas.py), and its algorithms: conv_algorithms.py (the convolutions) and
fused_recurrence.py.

Importing this package registers the backend's thread controls with lamina.threads, its check of
LAMINA_BLAS with lamina.threads.check_environment, and its one-pass index range with
lamina.backends.checks.
"""
import os as _os

from .blas import default_provider as _default_provider

# Decided before libgomp loads (it reads the environment once): lamina's own workers
# (lamina.threads) are pthreads of their own, and libgomp workers that spin-wait after each of the
# OpenMP kernels steal their cores where OpenBLAS is the provider. MKL threads through libgomp
# itself and gains from spinning, so where MKL is the provider its workers spin, but 10,000 turns
# (GOMP_SPINCOUNT) instead of libgomp's 300,000: after an OpenMP kernel (a gather of a batch's
# rows) they had held both cores while lamina's team multiplied, and an LSTM in bfloat16 on
# lamina's AMX panels ran 6.4-6.7 ms, 2.4-2.6 with 10,000 or 1,000 turns (an Intel Xeon with AMX,
# 2 threads); its float32 run on MKL 9.1 ms, 8.9-9.1 with 10,000 and 30,000, 11.0 with 1,000,
# 11.8 with OMP_WAIT_POLICY=PASSIVE. Set OMP_WAIT_POLICY or GOMP_SPINCOUNT to override.
#
# OpenBLAS's pool workers spin for 2^28 cycles (about 0.1 s) after each call before sleeping, on
# the cores lamina's next kernel wants. lamina's OpenBLAS runs on one thread (thread_hooks.py), but
# numpy's own OpenBLAS reads the same setting: a spin of 2^12 cycles is set here (read once, when
# each library loads; set OPENBLAS_THREAD_TIMEOUT to override).
try:
    _provider = _default_provider()
except ValueError:  # a bad LAMINA_BLAS: raised again, clearly, by the first CPU backend made
    _provider = None
if _provider == "openblas":
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")
elif _provider == "mkl" and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ.setdefault("GOMP_SPINCOUNT", "10000")

from ... import threads as _threads  # noqa: E402  (after the environment above is set)
from .. import checks as _checks  # noqa: E402
from . import compiled as _compiled  # noqa: E402
from .compiled import _kernels  # noqa: E402
from .backend import CPUBackend, PackedMatrix  # noqa: E402
from .thread_hooks import CPUThreadHooks  # noqa: E402

_threads.register_hooks(CPUThreadHooks())
_threads.register_environment_check(_default_provider)
_threads.register_environment_check(_compiled.chosen_path)
_checks.register_index_range(_kernels.index_range)

__all__ = ["CPUBackend", "PackedMatrix"]
