"""Instruction-set paths (lamina.backends.cpu.compiled): LAMINA_ISA picks the build, and the
kernel tests pass on the baseline path too, whatever this machine has, so every path is tested on
every machine (the default run tests the path this CPU takes)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.processor import instruction_sets

ROOT = Path(__file__).resolve().parent.parent
# the tests of the compiled CPU kernels: conformance, convolutions, the recurrence, selective
# rows, pools, bfloat16 conversion
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_conv_algorithms.py", "tests/test_recurrent.py",
                "tests/test_selective.py", "tests/test_volume.py", "tests/test_precision.py"]


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


@pytest.mark.parametrize("asked,path,module", [("baseline", "baseline", "_kernels_baseline"),
                                               ("auto", None, None)])
def test_lamina_isa_picks_the_build(asked, path, module):
    has_avx2 = {"avx2", "fma"} <= set(instruction_sets())
    path = path or ("avx2" if has_avx2 else "baseline")
    module = module or ("_kernels" if path == "avx2" else "_kernels_baseline")
    proc = run_python("from lamina.backends.cpu import compiled; "
                      "print(compiled.PATH, compiled._kernels.__name__.rsplit('.', 1)[1])", LAMINA_ISA=asked)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [path, module]


def test_a_bad_lamina_isa_is_one_clear_error():
    proc = run_python("import lamina; print('imported'); lamina.Network()", LAMINA_ISA="avx9000")
    assert proc.stdout.startswith("imported")
    assert proc.returncode != 0 and "LAMINA_ISA: expected one of auto, avx2, baseline, found 'avx9000'" in proc.stderr


def test_the_kernel_tests_pass_on_the_baseline_path():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *KERNEL_TESTS,
                           "-k", "not opencl and not reference-core", "-m", "not slow"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "LAMINA_ISA": "baseline"})
    tail = proc.stdout[-3000:]
    assert proc.returncode == 0, tail + proc.stderr[-2000:]
    assert " passed" in tail and "failed" not in tail
