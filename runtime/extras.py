"""The optional extras and what needs them: a feature that imports a package of an extra says,
when the package is missing, which extra installs it (`pip install 'lamina[serve]'`), rather than
ending in a bare ModuleNotFoundError."""
import importlib

from .errors import MissingExtra

EXTRAS = {
    "onnx": "importing and exporting ONNX models (lamina.onnx, lamina import/export)",
    "serve": "the inference server and its client (lamina serve, lamina.serve)",
    "grpc": "the inference server's gRPC service (lamina serve --grpc-port)",
    "mpi": "data-parallel training over MPI (lamina.distributed, mpiexec ... lamina train)",
    "opencl": "OpenCL devices (device='opencl', lamina devices)",
    "bench": "the benchmarks' peers and load generator (python -m bench)",
}


def require(module, extra):
    """Import `module` (a package of the extra `extra`), or raise MissingExtra naming the extra
    and what it is for."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtra(f"{EXTRAS[extra]} needs the package '{module.split('.')[0]}', which is not installed: "
                           f"pip install 'lamina[{extra}]' ({e})") from None
