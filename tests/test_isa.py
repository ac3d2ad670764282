"""Instruction-set paths (lamina.backends.cpu.compiled): LAMINA_ISA picks the build, and the
kernel tests pass on every path below the one this CPU takes (the default run tests that one), so
every path this machine can run is tested on it."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lamina.backends.cpu.compiled import NEEDS, PATH, PATHS
from lamina.processor import instruction_sets

ROOT = Path(__file__).resolve().parent.parent
# the tests of the compiled CPU kernels: conformance, convolutions, the recurrence, selective
# rows, pools, bfloat16 conversion
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_conv_algorithms.py", "tests/test_recurrent.py",
                "tests/test_selective.py", "tests/test_volume.py", "tests/test_precision.py", "tests/test_quantize.py",
                "tests/test_transformer.py"]


def run_python(code, **env):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, **env})


def runnable(path):
    return NEEDS[path] <= set(instruction_sets())


@pytest.mark.parametrize("asked", PATHS)
def test_lamina_isa_picks_the_build(asked):
    if asked != "auto" and not runnable(asked):
        proc = run_python("import lamina; lamina.Network()", LAMINA_ISA=asked)
        assert proc.returncode != 0 and f"LAMINA_ISA={asked}: this CPU lacks" in proc.stderr
        return
    path = next(p for p in PATHS[1:] if runnable(p)) if asked == "auto" else asked
    module = {"avx512": "_kernels_avx512", "avx2": "_kernels", "baseline": "_kernels_baseline"}[path]
    proc = run_python("from lamina.backends.cpu import compiled; "
                      "print(compiled.PATH, compiled._kernels.__name__.rsplit('.', 1)[1])", LAMINA_ISA=asked)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [path, module]


def test_a_bad_lamina_isa_is_one_clear_error():
    proc = run_python("import lamina; print('imported'); lamina.Network()", LAMINA_ISA="avx9000")
    assert proc.stdout.startswith("imported")
    assert proc.returncode != 0 and "LAMINA_ISA: expected one of auto, avx512, avx2, baseline, found 'avx9000'" \
        in proc.stderr


# the float32 cases in the default run (what inference and training take); every case in the
# slow run (make test-all): the float64 kernels (gradient checks) are their own vectorised code
@pytest.mark.parametrize("cases", ["not float64", pytest.param("", marks=pytest.mark.slow)],
                         ids=["float32", "all"])
def test_the_kernel_tests_pass_on_every_lower_path(cases):
    """Each path below the one this run takes, in a process of its own, all at once (each is
    mostly one busy Python thread)."""
    lower = [p for p in PATHS[1:] if p != PATH and runnable(p)]
    if not lower:
        pytest.skip(f"this CPU runs only the {PATH} path, which this run takes")
    selection = "not opencl and not reference-core" + (f" and {cases}" if cases else "")
    runs = {path: subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                    *KERNEL_TESTS, "-k", selection, "-m", "not slow"],
                                   cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "LAMINA_ISA": path}) for path in lower}
    for path, proc in runs.items():
        out, err = proc.communicate(timeout=900)
        tail = out[-3000:]
        assert proc.returncode == 0, f"LAMINA_ISA={path}:\n" + tail + err[-2000:]
        assert " passed" in tail and "failed" not in tail, path
