"""The GEMM providers behind the CPU backend: MKL and OpenBLAS (scipy-openblas32).

MKL is not the fastest BLAS everywhere: on AMD EPYC its sgemm runs at 0.5-0.95 of OpenBLAS's at
2 threads (measured on this project's AMD EPYC development machine). The provider is chosen from the CPU vendor (MKL on Intel, OpenBLAS
elsewhere) and forced with LAMINA_BLAS=mkl|openblas. Packed GEMM is MKL's alone and is available
whichever provider does plain GEMM.
"""
import importlib
import os

# provider name -> compiled module; imported lazily, so choosing one loads no OpenMP runtime
PROVIDERS = {"mkl": "lamina._mkl", "openblas": "lamina._openblas"}


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
        if forced not in PROVIDERS:
            raise ValueError(f"LAMINA_BLAS: expected one of {', '.join(PROVIDERS)}, found {forced!r}")
        return forced
    return "mkl" if cpu_vendor() == "GenuineIntel" else "openblas"


def provider(name):
    if name not in PROVIDERS:
        raise ValueError(f"BLAS provider: expected one of {', '.join(PROVIDERS)}, found {name!r}")
    return importlib.import_module(PROVIDERS[name])
