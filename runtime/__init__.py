"""lamina: a compact deep-learning runtime for CPU servers (Cython kernels over MKL/OpenBLAS)
and OpenCL devices."""
# the CPU backend first: it sets the OpenMP and OpenBLAS environment before numpy and the compiled
# kernels load their threading libraries
from .backends.cpu import CPUBackend
from . import layers, models, optim
from .backends.cpu.conv_algorithms import get_conv_algorithm, set_conv_algorithm
from . import errors as _errors
from .errors import (GradientCheckError, GraphError, IndexRangeError, InputError, MissingExtra, ModelFileError,
                     NonFiniteModelError, OpenCLError, ProtocolError, SequenceError, ServerError, SettingError,
                     TrainingStopped, UnsupportedModelError)
from .graph import Network, Spec, Value
from .io import load, load_checkpoint, save, save_checkpoint
from .io import onnx  # lm.onnx.load: the onnx package itself is imported only when it is used
from .parameter import Parameter
from .quantize import quantize
from .random import manual_seed
from .selection import Selection, sampled_selection, top_k
from .sequence import Sequences
from .threads import get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = ["Network", "Value", "Spec", "Parameter", "Sequences", "Selection", "sampled_selection", "top_k",
           "CPUBackend", "OpenCLBackend", "layers", "models", "optim", "onnx", "save", "load", "save_checkpoint",
           "load_checkpoint", "quantize", "manual_seed", "set_num_threads", "get_num_threads", "set_conv_algorithm",
           "get_conv_algorithm", *_errors.PUBLIC]


def __getattr__(name: str):
    """lamina.OpenCLBackend, imported when it is first asked for (the OpenCL backend needs
    pyopencl, the optional extra `opencl`)."""
    if name == "OpenCLBackend":
        from .backends.opencl import OpenCLBackend
        return OpenCLBackend
    raise AttributeError(f"module 'lamina' has no attribute {name!r}")
