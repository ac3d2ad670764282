import pytest

import lamina as lm
from lamina.backends.cpu import CPUBackend

# Every backend the conformance test holds to the numpy reference; the OpenCL backend joins here.
BACKENDS = {
    "cpu-mkl": lambda: CPUBackend(blas="mkl"),
    "cpu-openblas": lambda: CPUBackend(blas="openblas"),
}


@pytest.fixture(params=sorted(BACKENDS))
def backend(request):
    return BACKENDS[request.param]()


@pytest.fixture(autouse=True)
def _seeded():
    lm.manual_seed(1234)
    yield
