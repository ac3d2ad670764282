"""The GEMM providers behind the CPU backend: MKL and OpenBLAS (scipy-openblas32).

MKL is not the fastest BLAS everywhere: on AMD EPYC its sgemm runs at 0.5-0.95 of OpenBLAS's at
2 threads (measured on this project's AMD EPYC development machine). The provider is chosen from the CPU vendor (MKL on Intel, OpenBLAS
elsewhere) and forced with LAMINA_BLAS=mkl|openblas. Packed GEMM is MKL's alone and is available
whichever provider does plain GEMM.

OpenBLAS is always built. MKL is built where the build environment has mkl-devel (MKL has no
wheel for Arm hosts) and LAMINA_WITHOUT_MKL is not set; without it lamina runs on OpenBLAS alone.
"""
import importlib
import importlib.util
import os

# provider name -> compiled module; imported lazily, so choosing one loads no OpenMP runtime
PROVIDERS = {"mkl": "lamina._mkl", "openblas": "lamina._openblas"}


def built(name):
    """Whether this installation has the provider's module (found without loading it)."""
    return importlib.util.find_spec(PROVIDERS[name]) is not None


def available():
    """The providers this installation was built with, in PROVIDERS order."""
    return [name for name in PROVIDERS if built(name)]


def cpu_vendor():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def default_provider():
    forced = os.environ.get("LAMINA_BLAS")
    if forced:
        _check(forced, "LAMINA_BLAS")  # (not imported: this runs before libgomp may load)
        return forced
    return "mkl" if cpu_vendor() == "GenuineIntel" and built("mkl") else "openblas"


def provider(name, where="BLAS provider"):
    _check(name, where)
    return importlib.import_module(PROVIDERS[name])


def _check(name, where):
    if name not in PROVIDERS:
        raise ValueError(f"{where}: expected one of {', '.join(PROVIDERS)}, found {name!r}")
    if not built(name):
        raise ValueError(f"{where}: {name!r} is not in this installation (it was built without it: "
                         f"no mkl-devel in the build environment, or LAMINA_WITHOUT_MKL set); "
                         f"available: {', '.join(available())}")


def mkl():
    """MKL's module, or None where lamina was built without it."""
    return provider("mkl") if built("mkl") else None
