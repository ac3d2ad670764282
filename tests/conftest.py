import numpy as np
import pytest

import lamina as lm
from lamina.backends.cpu import CPUBackend


class OnDevice:
    """A device backend driven with numpy arrays: every array argument is copied to the device,
    the kernel runs there, and each array is copied back into the caller's (kernels write their
    outputs in place), so the numpy conformance tests hold a device backend to the reference
    unchanged. Strided views cannot be copied as they are: such tests skip."""

    def __init__(self, backend):
        self.backend = backend
        self.name = backend.name

    def __getattr__(self, name):
        attr = getattr(self.backend, name)
        return self._wrap(attr) if callable(attr) else attr

    def _wrap(self, kernel):
        def call(*args, **kwargs):
            uploaded = {}  # id(host array) -> (host array, device array): an array passed twice stays one

            def put(a):
                if isinstance(a, np.ndarray):
                    if not a.flags.c_contiguous:
                        pytest.skip("a strided numpy view has no device counterpart in this adapter")
                    if id(a) not in uploaded:
                        uploaded[id(a)] = (a, self.backend.from_host(a))
                    return uploaded[id(a)][1]
                if isinstance(a, tuple) and any(isinstance(v, np.ndarray) for v in a):
                    return tuple(put(v) for v in a)
                return a
            result = kernel(*[put(a) for a in args], **{k: put(v) for k, v in kwargs.items()})
            for host, device in uploaded.values():
                if host.flags.writeable:
                    host[...] = device.get()
            return result.get() if hasattr(result, "get") and not isinstance(result, (dict, float)) else result
        return call


def _opencl_backend():
    try:
        from lamina.backends.opencl import OpenCLBackend, devices
        return OpenCLBackend() if devices() else None
    except Exception:  # no pyopencl or no platform
        return None


_OPENCL = _opencl_backend()

# Every backend the conformance tests hold to the numpy reference.
BACKENDS = {
    "cpu-mkl": lambda: CPUBackend(blas="mkl"),
    "cpu-openblas": lambda: CPUBackend(blas="openblas"),
}
if _OPENCL is not None:
    BACKENDS["opencl"] = lambda: OnDevice(_OPENCL)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


@pytest.fixture
def cpu_backend(request):
    """For tests of the CPU backend's own behaviour (argument checks, threads)."""
    return CPUBackend()


@pytest.fixture(autouse=True)
def _seeded():
    lm.manual_seed(1234)
    yield
