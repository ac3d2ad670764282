"""lamina: a compact deep-learning runtime for CPU servers (Cython kernels over MKL/OpenBLAS)
and OpenCL devices."""
import os as _os

from .backends.blas import default_provider as _default_provider

# Decided before libgomp loads (it reads the environment once): lamina's own workers
# (lamina.threads) are pthreads of their own, and libgomp workers that spin-wait after each of our
# OpenMP kernels steal their cores (with OpenBLAS's pool in that place, fc forward+backward at 2
# threads measured 5x slower). MKL threads through libgomp itself and
# gains from spinning, so the default stays where MKL is the provider. Set OMP_WAIT_POLICY to
# override.
#
# OpenBLAS's pool workers spin for 2^28 cycles (about 0.1 s) after each call before sleeping, on
# the cores lamina's next kernel wants. lamina's OpenBLAS runs on one thread (lamina.threads), but
# numpy's own OpenBLAS reads the same setting: a spin of 2^12 cycles is set here (read once, when
# each library loads; set OPENBLAS_THREAD_TIMEOUT to override).
try:
    _provider = _default_provider()
except ValueError:  # a bad LAMINA_BLAS: raised again, clearly, by the first CPU backend made
    _provider = None
if _provider == "openblas":
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "12")
from . import layers, models, optim
from .backends.cpu import CPUBackend
from .backends.cpu.conv_algorithms import get_conv_algorithm, set_conv_algorithm
from . import errors as _errors
from .errors import (GradientCheckError, GraphError, IndexRangeError, InputError, MissingExtra, ModelFileError,
                     NonFiniteModelError, OpenCLError, ProtocolError, SequenceError, ServerError, SettingError,
                     TrainingStopped, UnsupportedModelError)
from .graph import Network, Spec, Value
from .io import load, load_checkpoint, save, save_checkpoint
from .io import onnx  # lm.onnx.load: the onnx package itself is imported only when it is used
from .parameter import Parameter
from .random import manual_seed
from .selection import Selection, sampled_selection, top_k
from .sequence import Sequences
from .threads import get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = ["Network", "Value", "Spec", "Parameter", "Sequences", "Selection", "sampled_selection", "top_k",
           "CPUBackend", "OpenCLBackend", "layers", "models", "optim", "onnx", "save", "load", "save_checkpoint",
           "load_checkpoint", "manual_seed", "set_num_threads", "get_num_threads", "set_conv_algorithm",
           "get_conv_algorithm", *_errors.PUBLIC]


def __getattr__(name: str):
    """lamina.OpenCLBackend, imported when it is first asked for (the OpenCL backend needs
    pyopencl, the optional extra `opencl`)."""
    if name == "OpenCLBackend":
        from .backends.opencl import OpenCLBackend
        return OpenCLBackend
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
