"""Instruction-set paths (lamina.backends.cpu.compiled): LAMINA_ISA picks the build, and the
kernel tests pass on every path below the one this CPU takes (the default run tests that one), so
every path this machine can run is tested on it."""
import os
import subprocess
import sys
import tempfile
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
    module = {"amx": "_kernels_avx512", "avx512": "_kernels_avx512", "avx2": "_kernels",
              "baseline": "_kernels_baseline"}[path]
    proc = run_python("from lamina.backends.cpu import compiled; "
                      "print(compiled.PATH, compiled._kernels.__name__.rsplit('.', 1)[1])", LAMINA_ISA=asked)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == [path, module]


def test_a_bad_lamina_isa_is_one_clear_error():
    proc = run_python("import lamina; print('imported'); lamina.Network()", LAMINA_ISA="avx9000")
    assert proc.stdout.startswith("imported")
    assert proc.returncode != 0 and "LAMINA_ISA: expected one of auto, amx, avx512, avx2, baseline, found 'avx9000'" \
        in proc.stderr


# the float32 cases in the default run (what inference and training take); every case in the
# slow run (make test-all): the float64 kernels (gradient checks) are their own vectorised code
LOWER_PATH_CASES = {"float32": "not float64", "all": ""}
_lower_path_runs: dict = {}  # cases -> {path: (the pytest process running KERNEL_TESTS on it, its output file)}


def lower_paths():
    return [p for p in PATHS[1:] if p != PATH and runnable(p)]


def start_in_background(item):
    """Starts the lower-path runs of a collected test item (the background mark: conftest calls
    this once collection ends), so that they run on the cores the rest of the session leaves idle
    (it is mostly one busy Python thread) and the test only collects them."""
    cases = item.callspec.params["cases"]
    if cases not in _lower_path_runs:
        selection = "not opencl and not reference-core" + (f" and {LOWER_PATH_CASES[cases]}"
                                                           if LOWER_PATH_CASES[cases] else "")
        runs = _lower_path_runs[cases] = {}
        for path in lower_paths():
            output = tempfile.TemporaryFile()
            runs[path] = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                                           *KERNEL_TESTS, "-k", selection, "-m", "not slow"],
                                          cwd=ROOT, stdout=output, stderr=subprocess.STDOUT,
                                          env={**os.environ, "LAMINA_ISA": path},
                                          preexec_fn=lambda: os.nice(5)), output
    return _lower_path_runs[cases]


def stop_in_background():
    """Ends the lower-path runs still going when the session ends (it was interrupted)."""
    for runs in _lower_path_runs.values():
        for proc, _ in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


@pytest.mark.background(start_in_background, stop_in_background)
@pytest.mark.parametrize("cases", ["float32", pytest.param("all", marks=pytest.mark.slow)])
def test_the_kernel_tests_pass_on_every_lower_path(cases, request):
    """Each path below the one this run takes, in a process of its own, all at once (each is
    mostly one busy Python thread), started when collection ended."""
    if not lower_paths():
        pytest.skip(f"this CPU runs only the {PATH} path, which this run takes")
    for path, (proc, output) in start_in_background(request.node).items():
        proc.wait(timeout=900)
        output.seek(0)
        tail = output.read().decode(errors="replace")[-4000:]
        assert proc.returncode == 0, f"LAMINA_ISA={path}:\n" + tail
        assert " passed" in tail and "failed" not in tail, path
