"""An OpenCL device whose compiler cannot generate code for this machine's CPU (conftest leaves it
out of the OpenCL cases): lamina's first kernel build on it fails with an error that says so."""
import numpy as np
import pytest

import lamina as lm
from conftest import _REFUSED

pytestmark = pytest.mark.skipif(not _REFUSED, reason="every OpenCL device here compiles for this CPU")


def test_a_compiler_that_refuses_the_cpu_is_named_in_the_error():
    from lamina.backends.opencl import OpenCLBackend, devices
    from lamina.errors import OpenCLError
    index = next(i for i, d in enumerate(devices()) if d.name.strip() in _REFUSED)
    net = lm.Network()
    net.outputs(y=lm.layers.Linear(4, 3)(net.input("x", 4)))
    with pytest.raises(OpenCLError, match=r"unknown target CPU[\s\S]*does not know this CPU"):
        net.to(OpenCLBackend(index))
        net.run({"x": np.ones((2, 4), np.float32)})
