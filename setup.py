"""Builds lamina's Cython kernels against MKL (mkl-devel wheel) and OpenBLAS (scipy-openblas32).

Everything is found inside the Python environment that runs the build: no system MKL and no
LD_LIBRARY_PATH. Each extension gets two rpaths: the folder that held its library at build time
(an editable install), and the place the library's wheel installs it relative to the extension's
folder, site-packages/lamina/backends/cpu: OpenBLAS's library in
$ORIGIN/../../../scipy_openblas32/lib, MKL's runtime in PREFIX/lib, that is $ORIGIN/../../../../..
So a wheel built in pip's isolated environment, whose folders are gone after the build, loads in
the environment it is installed in. lamina.backends.cpu.blas also loads each
library from its installed distribution before the module that needs it.

MKL is optional: where the environment has no mkl-devel (MKL has no wheel for Arm hosts), or
LAMINA_WITHOUT_MKL=1 is set, lamina is built without its MKL provider and runs on OpenBLAS alone.
"""
import os
import platform
import sys
import sysconfig
from pathlib import Path

import numpy
from Cython.Build import cythonize
from setuptools import Extension, find_packages, setup


def _prefixes():
    """Environment roots to search: this interpreter's prefix and any build-isolation overlay."""
    seen = []
    for p in [sys.prefix, sys.base_prefix, *sys.path]:
        path = Path(p)
        # site-packages lives at PREFIX/lib/pythonX.Y/site-packages
        for root in (path, *path.parents[:3]):
            if root not in seen:
                seen.append(root)
    return seen


def _find(relative):
    """The environment root that holds `relative`, or None."""
    return next((root for root in _prefixes() if (root / relative).exists()), None)


def _mkl_location():
    """(MKL's root, the file name of its runtime library), or None to build without MKL."""
    if os.environ.get("LAMINA_WITHOUT_MKL", "") not in ("", "0"):
        print("lamina build: LAMINA_WITHOUT_MKL is set: building without MKL (OpenBLAS alone)")
        return None
    root = _find("include/mkl.h")
    if root is None:
        print(f"lamina build: no MKL (mkl-devel's include/mkl.h) in the Python environment (searched "
              f"{[str(p) for p in _prefixes()][:6]} ...): building without MKL (OpenBLAS alone)")
        return None
    runtime = sorted((root / "lib").glob("libmkl_rt.so*"))
    if not runtime:
        raise SystemExit(f"lamina build: mkl-devel's headers are in {root} but no libmkl_rt.so* is in {root / 'lib'}")
    return root, runtime[0].name


mkl = _mkl_location()

import scipy_openblas32  # noqa: E402  (a build requirement)

openblas_lib = scipy_openblas32.get_lib_dir()
openblas_inc = scipy_openblas32.get_include_dir()

# -fno-trapping-math lets gcc turn conditional expressions into blends and vectorise the
# loops that use them (no kernel relies on floating-point traps)
# (-fno-math-errno: lamina never reads errno, and without it gcc keeps sqrt out of vector lanes)
common_compile = ["-O3", "-fno-trapping-math", "-fno-math-errno", "-fopenmp", "-Wno-unused-function", "-Wno-unreachable-code"]
common_link = ["-fopenmp"]
np_macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]

KERNEL_HEADERS = ["cells.h", "cells_impl.h", "clones.h", "panels.h", "panels_impl.h", "recurrence.h", "recurrence_impl.h",
                  "volumes.h", "volumes_impl.h", "direct_conv.h", "direct_conv_impl.h", "direct_dw_impl.h", "winograd.h",
                  "winograd_impl.h",
                  "pools.h", "pools_impl.h", "softmax.h", "softmax_impl.h", "epilogue.h", "epilogue_impl.h",
                  "instantiate.h", "team.h", "convert.h", "quantize.h", "depthwise.h", "depthwise_impl.h", "attention.h",
                  "attention_impl.h", "norms.h", "norms_impl.h", "activations.h", "optimizers.h", "optimizers_impl.h",
                  "int8_panels.h", "dot_panel_impl.h", "dot_panels.h", "bf16_panels.h", "amx_tiles.h", "amx_panel_impl.h"]
# (module suffix, macros, compiler flags): the build with the AVX2 clones, the baseline alone, and
# on x86-64 one whose hot loops are compiled for the AVX-512 target (x86-64-v4) alone (clones.h:
# by function attributes, so the rest of the module, its set-up at import included, stays
# baseline code and imports on any x86-64 CPU)
ISA_BUILDS = [("", [], []), ("_baseline", [("LAMINA_NO_CLONES", "1")], [])]
if platform.machine() in ("x86_64", "AMD64"):
    ISA_BUILDS.append(("_avx512", [("LAMINA_NO_CLONES", "1"), ("LAMINA_TARGET_V4", "1")], []))

extensions = [
    Extension(
        "lamina.backends.cpu._openblas",
        ["pyx/_openblas.pyx"],
        include_dirs=[openblas_inc, numpy.get_include()],
        extra_link_args=common_link
        + [f"-L{openblas_lib}", f"-l{scipy_openblas32.get_library()}", f"-Wl,-rpath,{openblas_lib}",
           "-Wl,-rpath,$ORIGIN/../../../scipy_openblas32/lib"],
        extra_compile_args=common_compile,
        define_macros=np_macros,
    ),
    # the row and cell kernels with their AVX2 clones, and again for the baseline alone
    # (LAMINA_ISA=baseline): every instruction-set path can then be tested on any machine
    *(Extension(
        f"lamina.backends.cpu._kernels{suffix}",
        [f"pyx/_kernels{suffix}.pyx"],
        include_dirs=["pyx", numpy.get_include()],
        depends=["pyx/_kernels.pyx"] + [f"pyx/{h}" for h in KERNEL_HEADERS],
        extra_link_args=common_link,
        extra_compile_args=common_compile + flags,
        define_macros=np_macros + macros,
    ) for suffix, macros, flags in ISA_BUILDS),
    *(Extension(
        f"lamina.backends.cpu._selective{suffix}",
        [f"pyx/_selective{suffix}.pyx"],
        include_dirs=["pyx", numpy.get_include()],
        depends=["pyx/_selective.pyx", "pyx/rows.h", "pyx/clones.h"],
        extra_link_args=common_link,
        extra_compile_args=common_compile + flags,
        define_macros=np_macros + macros,
    ) for suffix, macros, flags in ISA_BUILDS),
]
# The OpenCL backend's step enqueuer: calls the OpenCL library pyopencl loaded through addresses
# given at run time, so it builds without OpenCL headers or library
extensions.append(Extension(
    "lamina.backends._opencl_steps",
    ["pyx/_opencl_steps.pyx"],
    extra_compile_args=["-O2"],
))
if mkl is not None:
    mkl_root, mkl_runtime = mkl
    extensions.append(Extension(
        "lamina.backends.cpu._mkl",
        ["pyx/_mkl.pyx"],
        include_dirs=[str(mkl_root / "include"), numpy.get_include()],
        # link the versioned runtime by file name: the wheel ships no unversioned libmkl_rt.so
        extra_link_args=common_link + [f"-L{mkl_root / 'lib'}", f"-l:{mkl_runtime}", f"-Wl,-rpath,{mkl_root / 'lib'}",
                                       "-Wl,-rpath,$ORIGIN/../../../../.."],
        extra_compile_args=common_compile,
        define_macros=np_macros,
    ))

setup(
    # every package under runtime/ (a new subpackage ships without being listed here)
    packages=["lamina"] + [f"lamina.{name}" for name in find_packages("runtime")] + ["lamina.opencl", "lamina.models"],
    package_dir={"lamina": "runtime", "lamina.opencl": "opencl", "lamina.models": "models"},
    package_data={"lamina.opencl": ["*.cl", "*.h"], "lamina.models": ["*/model.lamina", "*/README.md"],
                  "lamina": ["py.typed"], "lamina.backends.cpu": ["*.pyi"], "lamina.backends": ["*.pyi"], "lamina.serve.grpc": ["inference.proto"]},
    # the extensions compile side by side, one per core (the kernels twice: see ISA_BUILDS)
    options={"build_ext": {"parallel": os.cpu_count() or 1}},
    ext_modules=cythonize(
        extensions,
        nthreads=os.cpu_count() or 1,
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
        },
    ),
)
