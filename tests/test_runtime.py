"""Threads and BLAS provider choice: one place sets them, environment variables force them."""
import os
import subprocess
import sys

import pytest

import lamina as lm
from lamina import _kernels, _mkl, _openblas


def run_python(code, **env):
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    return out.returncode, out.stdout.strip(), out.stderr.strip()


def test_set_num_threads_reaches_every_runtime():
    before = lm.get_num_threads()
    try:
        lm.set_num_threads(1)
        assert (_kernels.get_num_threads(), _mkl.get_num_threads(), _openblas.get_num_threads()) == (1, 1, 1)
        lm.set_num_threads(2)
        # OpenBLAS stays on one thread: the CPU backend splits its GEMMs between lamina's threads
        assert (_kernels.get_num_threads(), _mkl.get_num_threads(), _openblas.get_num_threads()) == (2, 2, 1)
    finally:
        lm.set_num_threads(before)
    with pytest.raises(ValueError, match="positive integer, found 0"):
        lm.set_num_threads(0)


def test_lamina_threads_environment_variable():
    code = "import lamina, lamina._mkl as m; print(lamina.get_num_threads(), m.get_num_threads())"
    assert run_python(code, LAMINA_THREADS="1")[1] == "1 1"
    # a bad value does not break `import lamina` (the command reports it in one line); the first
    # network made raises it
    rc, out, err = run_python("import lamina; print('imported'); lamina.Network()", LAMINA_THREADS="many")
    assert out.startswith("imported")
    assert rc != 0 and "LAMINA_THREADS: expected a positive integer, found 'many'" in err


def test_lamina_blas_forces_the_provider():
    code = "import lamina; print(lamina.CPUBackend().blas_name)"
    assert run_python(code, LAMINA_BLAS="mkl")[1] == "mkl"
    assert run_python(code, LAMINA_BLAS="openblas")[1] == "openblas"
    rc, _, err = run_python(code, LAMINA_BLAS="atlas")
    assert rc != 0 and "LAMINA_BLAS: expected one of mkl, openblas, found 'atlas'" in err


def test_mkl_uses_the_gnu_openmp_layer():
    """MKL threads through gcc's libgomp, the runtime the Cython kernels use (code 3 = GNU)."""
    assert _mkl.threading_layer == 3
    maps = open(f"/proc/{os.getpid()}/maps").read()
    assert "libgomp" in maps and "libiomp5" not in maps
