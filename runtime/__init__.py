"""lamina: a compact deep-learning runtime for CPU servers (Cython kernels over MKL/OpenBLAS)
and OpenCL devices."""
from . import layers, optim
from .backends.cpu import CPUBackend
from .errors import GraphError, InputError
from .graph import Network, Spec, Value
from .io import load, save
from .parameter import Parameter
from .random import manual_seed
from .threads import get_num_threads, set_num_threads

__version__ = "0.1.0"

__all__ = ["Network", "Value", "Spec", "Parameter", "CPUBackend", "GraphError", "InputError",
           "layers", "optim", "save", "load", "manual_seed", "set_num_threads", "get_num_threads"]
