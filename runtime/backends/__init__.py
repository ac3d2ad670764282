"""Backends: the CPU (numpy + Cython + MKL/OpenBLAS) and OpenCL (pyopencl)."""


def get_backend(device):
    """A backend for 'cpu', 'opencl' or 'opencl:N' (or a backend object, returned as it is)."""
    if not isinstance(device, str):
        return device
    if device == "cpu":
        from .cpu import CPUBackend
        return CPUBackend()
    kind, _, index = device.partition(":")
    if kind == "opencl":
        from .opencl import OpenCLBackend
        return OpenCLBackend(index or None)
    raise ValueError(f"device must be 'cpu', 'opencl' or 'opencl:N', found {device!r}")
