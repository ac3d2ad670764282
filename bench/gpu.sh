#!/usr/bin/env bash
# lamina's OpenCL checks on a GPU machine, in one go (about 10 minutes on one NVIDIA H100/H200):
#   1. builds lamina in place into a new virtual environment (without MKL: its wheel is not
#      needed for the OpenCL backend; OpenBLAS serves the CPU rows),
#   2. runs the OpenCL tests on the first GPU (PYOPENCL_TEST picks another device),
#   3. times the GEMM at 4096^3 and runs `python -m bench opencl` (the GPU beside this machine's
#      CPU cores; each recurrent row gives host_us_per_step, each row transfers_per_step).
# Output: $OUT (default bench/results/gpu) gets clinfo.txt, tests.log, gemm.txt, bench.log and
# opencl.json. Packages come from pip's index, or from wheels in ./.whl where the machine has no
# network (pip download them elsewhere: numpy, Cython, setuptools, wheel, scipy-openblas32,
# pyopencl, platformdirs, pytools, typing-extensions, pytest, pytest-timeout, safetensors, tqdm,
# httpx and its needs).
# Usage: bash bench/gpu.sh            (from the repository root)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-bench/results/gpu}
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
VENV=${VENV:-/tmp/lamina-gpu-venv}
export PYTHONUNBUFFERED=1

$PYTHON -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip install -q)
if [ -d .whl ]; then PIP+=(--no-index --find-links .whl); fi
"${PIP[@]}" "setuptools>=77" wheel "Cython==3.3.1" "numpy>=2.0,<3" "scipy-openblas32==0.3.34.481.3"
"${PIP[@]}" pyopencl pytest pytest-timeout safetensors tqdm httpx
LAMINA_WITHOUT_MKL=1 "$VENV/bin/python" -m pip install -q --no-build-isolation --no-deps -e . \
    $( [ -d .whl ] && echo --no-index --find-links .whl )
PY="$VENV/bin/python"

"$PY" - > "$OUT/clinfo.txt" <<'EOF'
import pyopencl as cl
for p in cl.get_platforms():
    for d in p.get_devices():
        print(f"{p.name} | {d.name} | {cl.device_type.to_string(d.type)} | {d.max_compute_units} CUs | "
              f"{d.global_mem_size >> 20} MiB | local {d.local_mem_size} B | {d.version} | {d.driver_version}")
EOF
cat "$OUT/clinfo.txt"
export PYOPENCL_TEST=${PYOPENCL_TEST:-$("$PY" -c "
import pyopencl as cl
gpus = [d for p in cl.get_platforms() for d in p.get_devices() if d.type & cl.device_type.GPU]
print(gpus[0].platform.name.split()[0].lower() if gpus else '')")}
echo "device for the tests: PYOPENCL_TEST=$PYOPENCL_TEST"

# the OpenCL tests (those of test_opencl.py and every OpenCL case elsewhere)
"$PY" -m pytest -q -p no:cacheprovider -m "not slow" -k opencl --timeout=300 tests 2>&1 | tee "$OUT/tests.log" | tail -5 || true

# the GEMM at 1024^3 to 4096^3 on the first GPU, with the tiles lamina chooses for it and with
# each other tile choice (LAMINA_OPENCL_TILES): median of 5 after a warm-up
for tiles in "" 128,128,16,8,8 64,64,16,8,8 32,32,8,4,4; do
LAMINA_OPENCL_TILES=$tiles "$PY" - 2>&1 <<'EOF' | tee -a "$OUT/gemm.txt"
import statistics, time
import numpy as np
import pyopencl as cl
from lamina.backends.opencl import OpenCLBackend, devices
index = next(i for i, d in enumerate(devices()) if d.type & cl.device_type.GPU)
be = OpenCLBackend(index)
for n in (1024, 2048, 4096):
    a = be.from_host(np.random.default_rng(0).standard_normal((n, n)).astype(np.float32))
    c = be.empty((n, n), np.float32)
    be.gemm(a, a, c); be.queue.finish()
    times = []
    for _ in range(5):
        t = time.perf_counter(); be.gemm(a, a, c); be.queue.finish(); times.append(time.perf_counter() - t)
    print(f"{be.device.name.strip()} tiles {be.tiles} gemm {n}^3: "
          f"{2 * n ** 3 / statistics.median(times) / 1e12:.2f} TFLOP/s (median of 5, {1e3 * statistics.median(times):.2f} ms)")
EOF
done

"$PY" -m bench opencl --threads "$(nproc)" --rounds 3 --json "$OUT/opencl.json" 2>&1 | tee "$OUT/bench.log"
