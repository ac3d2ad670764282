import hashlib
import importlib.util
import os

import numpy as np
import pytest

import lamina as lm
from lamina.backends.cpu.blas import available, built
from lamina.backends.cpu import CPUBackend
from lamina.backends.reference import ReferenceBackend
from lamina.testing import core_only

# Property-based tests (hypothesis) draw new examples on every run here; in CI (CI set) they draw
# the same ones every run, so a submission's result does not depend on the draw.
try:
    from hypothesis import settings as _hypothesis_settings
    _hypothesis_settings.register_profile("ci", derandomize=True, database=None)
    if os.environ.get("CI"):
        _hypothesis_settings.load_profile("ci")
except ImportError:
    pass

# The CPU backend's GEMM providers in this build (MKL is optional: setup.py builds without it where
# mkl-devel is absent), and a mark for tests that need MKL itself.
BLAS_PROVIDERS = available()
needs_mkl = pytest.mark.skipif(not built("mkl"), reason="lamina was built without MKL (no mkl-devel)")


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


def compiler_refuses_the_cpu(device):
    """The line of the build log that says the device's compiler cannot generate code for this
    machine's CPU at all (PoCL 3.0's LLVM 14, the PoCL wheel's, names CPUs newer than it, such as
    AMD's family 26 (Zen 5), 'generic', then refuses that name for every program), else None."""
    import pyopencl as cl
    program = cl.Program(cl.Context([device]), "__kernel void probe(__global float *a) { a[0] = 1.0f; }")
    try:
        program.build()
    except cl.Error as error:
        refusal = [line.strip() for line in str(error).splitlines() if "unknown target CPU" in line]
        if refusal:
            return refusal[0]
        raise
    return None


_REFUSED: dict = {}  # device name -> its compiler's refusal of this CPU (the session's header and summary name it)


def opencl_devices():
    """The OpenCL devices the tests run on (PYOPENCL_TEST filters them by name, as pyopencl's own
    tests do). Without pyopencl there are none and the OpenCL cases skip; but where PoCL is
    installed (`make test` always installs it) an OpenCL backend that fails to import or finds no
    device is an error, so OpenCL coverage can never vanish into skips. The one exception: a
    device whose compiler cannot target this machine's CPU at all (compiler_refuses_the_cpu) runs
    no program, lamina's or any other; it is left out, and the session's header and summary say so."""
    pocl = importlib.util.find_spec("pocl_binary_distribution") is not None
    if importlib.util.find_spec("pyopencl") is None and not pocl:
        return []
    from lamina.backends.opencl import devices  # an import error here fails the run
    found = devices()
    if os.environ.get("PYOPENCL_TEST"):
        found = [d for d in found if os.environ["PYOPENCL_TEST"].lower() in d.name.lower()]
    for device in found:
        refusal = compiler_refuses_the_cpu(device)
        if refusal:
            _REFUSED[device.name.strip()] = refusal
    usable = [d for d in found if d.name.strip() not in _REFUSED]
    if pocl and not found:
        raise RuntimeError("PoCL is installed but lamina finds no OpenCL device"
                           f"{' matching PYOPENCL_TEST' if os.environ.get('PYOPENCL_TEST') else ''}")
    return usable


def _refusals():
    return [f"OpenCL device {name} left out: its compiler cannot target this CPU ({why})"
            for name, why in _REFUSED.items()]


def pytest_report_header(config):
    return _refusals()


def pytest_terminal_summary(terminalreporter):
    for line in _refusals():
        terminalreporter.write_line(line, yellow=True)


OPENCL_DEVICES = opencl_devices()
NO_OPENCL = ("no OpenCL device that runs programs here (pyopencl[pocl] not installed, or its compiler refuses "
             "this CPU: the session's summary names it)")
_OPENCL = None
if OPENCL_DEVICES:
    from lamina.backends.opencl import OpenCLBackend, devices
    _OPENCL = OpenCLBackend(devices().index(OPENCL_DEVICES[0]))

# Every backend the conformance tests hold to the numpy reference.
BACKENDS = {f"cpu-{blas}": lambda blas=blas: CPUBackend(blas=blas) for blas in BLAS_PROVIDERS}
# the reference stripped to the core kernels: every composed operation runs as Backend composes it
BACKENDS["reference-core"] = lambda: core_only(ReferenceBackend)()
if _OPENCL is not None:
    BACKENDS["opencl"] = lambda: OnDevice(_OPENCL)


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


# What multiplies bfloat16 and int8 on the CPU (CPUBackend.low_precision): a machine takes one path
# by default, and the tests of those precisions run every one, with each float32 provider.
LOW_PRECISION_PATHS = ["lamina", "float32"] + (["mkl"] if built("mkl") else [])
REDUCED_BACKENDS = {**{name: make for name, make in BACKENDS.items() if not name.startswith("cpu-")},
                    **{f"cpu-{blas}-{path}-products": lambda blas=blas, path=path: CPUBackend(blas, path)
                       for blas in BLAS_PROVIDERS for path in LOW_PRECISION_PATHS}}


@pytest.fixture(params=sorted(REDUCED_BACKENDS))
def reduced_backend(request):
    """Every backend, the CPU's with each path for bfloat16 and int8 products."""
    return REDUCED_BACKENDS[request.param]()


@pytest.fixture(params=LOW_PRECISION_PATHS)
def low_precision(request):
    """A CPU backend's path for bfloat16 and int8 products ('lamina', 'float32' or 'mkl'), the other
    settings the machine's own."""
    return request.param


@pytest.fixture
def cpu_backend(request):
    """For tests of the CPU backend's own behaviour (argument checks, threads)."""
    return CPUBackend()


@pytest.fixture(autouse=True)
def _seeded():
    lm.manual_seed(1234)
    yield


def stable_rng(*key):
    """A generator seeded from a digest of `key` (Python's hash() of strings changes per process,
    so a data-dependent failure could not be reproduced)."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


# Tests that run a long subprocess (marked background(start, stop)) start it as soon as
# collection ends and run last, so that it runs on the core the rest of the session leaves idle
# and the test itself only collects its result; what is still running when the session ends is
# stopped.
_background_stops: set = set()


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: item.get_closest_marker("background") is not None)


def pytest_collection_finish(session):
    for item in session.items:
        marker = item.get_closest_marker("background")
        if marker is not None:
            start, stop = marker.args
            start(item)
            _background_stops.add(stop)


def pytest_sessionfinish(session):
    for stop in _background_stops:
        stop()
