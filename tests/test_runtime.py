"""Threads and BLAS provider choice: one place sets them, environment variables force them."""
import os
import subprocess
import sys

import pytest

import lamina as lm
from lamina.backends.cpu import _kernels, _openblas
from lamina.backends.cpu.blas import mkl

from conftest import needs_mkl

_mkl = mkl()  # None where lamina was built without MKL


def run_python(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    return out.returncode, out.stdout.strip(), out.stderr.strip()


def test_set_num_threads_reaches_every_runtime():
    before = lm.get_num_threads()
    try:
        runtimes = [_kernels, _openblas] + ([_mkl] if _mkl is not None else [])
        lm.set_num_threads(1)
        assert [r.get_num_threads() for r in runtimes] == [1, 1, 1][:len(runtimes)]
        lm.set_num_threads(2)
        # OpenBLAS stays on one thread: the CPU backend splits its GEMMs between lamina's threads
        assert [r.get_num_threads() for r in runtimes] == [2, 1, 2][:len(runtimes)]
    finally:
        lm.set_num_threads(before)
    with pytest.raises(ValueError, match="positive integer, found 0"):
        lm.set_num_threads(0)


def test_lamina_threads_environment_variable():
    code = ("import lamina, lamina.backends.cpu._kernels as k; from lamina.backends.cpu.blas import mkl; "
            "print(lamina.get_num_threads(), k.get_num_threads(), (mkl() or k).get_num_threads())")
    assert run_python(code, LAMINA_THREADS="1")[1] == "1 1 1"
    # a bad value does not break `import lamina` (the command reports it in one line); the first
    # network made raises it
    rc, out, err = run_python("import lamina; print('imported'); lamina.Network()", LAMINA_THREADS="many")
    assert out.startswith("imported")
    assert rc != 0 and "LAMINA_THREADS: expected a positive integer, found 'many'" in err


@needs_mkl
def test_lamina_blas_forces_the_provider():
    code = "import lamina; print(lamina.CPUBackend().blas_name)"
    assert run_python(code, LAMINA_BLAS="mkl")[1] == "mkl"
    assert run_python(code, LAMINA_BLAS="openblas")[1] == "openblas"
    rc, _, err = run_python(code, LAMINA_BLAS="atlas")
    assert rc != 0 and "LAMINA_BLAS: expected one of mkl, openblas, found 'atlas'" in err


@needs_mkl
def test_the_openmp_and_openblas_spins_follow_the_provider():
    """Set before libgomp loads, unless the user set them: with OpenBLAS, libgomp's workers sleep
    at once and OpenBLAS's spin briefly; with MKL, libgomp's workers spin 10,000 turns."""
    names = ("OMP_WAIT_POLICY", "OPENBLAS_THREAD_TIMEOUT", "GOMP_SPINCOUNT")
    code = f"import os, lamina; print(*(os.environ.get(k, '-') for k in {names}))"

    def settings(**env):
        clean = {k: v for k, v in os.environ.items() if k not in names}
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout.split()
    assert settings(LAMINA_BLAS="openblas") == ["PASSIVE", "12", "-"]
    assert settings(LAMINA_BLAS="mkl") == ["-", "-", "10000"]
    assert settings(LAMINA_BLAS="mkl", OMP_WAIT_POLICY="ACTIVE") == ["ACTIVE", "-", "-"]
    assert settings(LAMINA_BLAS="mkl", GOMP_SPINCOUNT="5") == ["-", "-", "5"]


@needs_mkl
def test_mkl_uses_the_gnu_openmp_layer():
    """MKL threads through gcc's libgomp, the runtime the Cython kernels use (code 3 = GNU)."""
    assert _mkl.threading_layer == 3
    maps = open(f"/proc/{os.getpid()}/maps").read()
    assert "libgomp" in maps and "libiomp5" not in maps


def test_a_build_without_mkl_runs_on_openblas():
    """Where lamina was built without MKL (no mkl-devel: an Arm host), it runs on OpenBLAS, and asking
    for MKL says it is not in this installation. The module's absence is simulated here."""
    absent = "import sys; sys.modules['lamina.backends.cpu._mkl'] = None; "
    code = absent + """
import numpy as np, lamina as lm
from lamina.backends.cpu.blas import available
lm.manual_seed(0)
net = lm.Network()
x = net.input("x", 4)
net.outputs(y=lm.layers.Linear(4, 3)(x))
layer = net.layers[0]
y = net.run({"x": np.ones((2, 4), np.float32)})["y"]
w, b = layer.weight.value, layer.bias.value
np.testing.assert_allclose(y, np.ones((2, 4), np.float32) @ w.T + b, rtol=1e-6, atol=1e-6)  # (sums of ~0.1 terms)
lm.set_num_threads(1)
print(available(), lm.CPUBackend().blas_name, lm.get_num_threads())
"""
    rc, out, err = run_python(code)
    assert rc == 0, err
    assert out == "['openblas'] openblas 1"
    for setting in ("lamina.CPUBackend(blas='mkl')", ""):
        rc, _, err = run_python(absent + f"import lamina; lamina.Network(); {setting}", LAMINA_BLAS="mkl" if not setting else "")
        assert rc != 0 and "'mkl' is not in this installation (it was built without it" in err, err
        assert "available: openblas" in err
