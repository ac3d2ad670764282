"""The GEMM providers behind the CPU backend: MKL and OpenBLAS (scipy-openblas32).

MKL is not the fastest BLAS everywhere: on AMD processors its sgemm runs behind OpenBLAS's. The
provider is chosen from the CPU vendor (MKL on Intel, OpenBLAS elsewhere) and forced with
LAMINA_BLAS=mkl|openblas. Likewise the products of bfloat16 and int8 networks: MKL's on Intel,
lamina's own elsewhere (its int8 panels, its bfloat16 panels on AVX512-BF16, else float32 products
of the rounded operands: low_precision_products).

OpenBLAS is always built. MKL is built where the build environment has mkl-devel (MKL has no
wheel for Arm hosts) and LAMINA_WITHOUT_MKL is not set; without it lamina runs on OpenBLAS alone.
"""
import ctypes
import importlib
import importlib.util
import os

# provider name -> compiled module; imported lazily, so choosing one loads no OpenMP runtime
PROVIDERS = {"mkl": "lamina.backends.cpu._mkl", "openblas": "lamina.backends.cpu._openblas"}
# provider name -> (the distribution that ships its shared library, the library's file name prefix)
LIBRARIES = {"mkl": ("mkl", "libmkl_rt.so"), "openblas": ("scipy-openblas32", "libscipy_openblas")}
_loaded: set[str] = set()


def load_library(name):
    """Load the provider's shared library from the installed distribution that ships it (the
    `mkl` and `scipy-openblas32` wheels), before its compiled module needs it: the dynamic
    loader then finds it by name however lamina was installed (a wheel in another environment,
    --target, --user), where the rpaths recorded at build time may not lead to it. A library
    not found this way is left to those rpaths."""
    if name in _loaded:
        return
    _loaded.add(name)
    distribution, prefix = LIBRARIES[name]
    try:
        from importlib.metadata import PackageNotFoundError, files
        listed = files(distribution) or []
    except (ImportError, PackageNotFoundError):
        return
    for entry in listed:
        if entry.name.startswith(prefix) and ".so" in entry.name:
            try:
                ctypes.CDLL(str(entry.locate()), mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            return


def built(name):
    """Whether this installation has the provider's module (found without loading it)."""
    return importlib.util.find_spec(PROVIDERS[name]) is not None


def available():
    """The providers this installation was built with, in PROVIDERS order."""
    return [name for name in PROVIDERS if built(name)]


def cpu_vendor():
    from ...processor import vendor
    return vendor()


def default_provider():
    forced = os.environ.get("LAMINA_BLAS")
    if forced:
        _check(forced, "LAMINA_BLAS")  # (not imported: this runs before libgomp may load)
        return forced
    return "mkl" if cpu_vendor() == "GenuineIntel" and built("mkl") else "openblas"


def low_precision_products():
    """Which products serve bfloat16 and int8 (lamina.precision):
    - 'mkl': MKL's packed bfloat16 and u8 x s8 GEMMs, which run MKL's own kernels on Intel CPUs
      (AMX, AVX512-BF16, VNNI);
    - 'lamina': lamina's own u8 x s8 panels for int8 (pyx/int8_panels.h: AVX2 or AVX-512 VNNI,
      activations in 127 steps), for bfloat16 its bfloat16 panels where the CPU has AVX512-BF16
      (pyx/bf16_panels.h), else float32 products of the operands rounded to bfloat16;
    - 'float32': the float32 provider's products of the reduced operands for both (int8: the
      activations snapped to 255 steps; the same values as an int8 product, summed in float32).
    Where lamina's panels run on AMX tiles (the kernels' path 'amx'), lamina's: on an Intel Xeon
    with AMX, 2 threads, they ran 1.2-1.6x MKL's AMX products for the shapes of a Linear and an
    LSTM (1920 x 256 x 1024, 256 x 1024 x 1024, 64 x 256 x 1024) in both precisions, and the LSTM's
    recurrence fuses into one compiled call on them. Elsewhere on Intel, MKL; on other CPUs lamina's
    where its int8 kernel has vector code for the CPU (AVX2), else float32: on an AMD EPYC (AVX2)
    MKL's u8 x s8 products ran at 41 GOP/s against 111-122 GFLOP/s for its float32 ones, lamina's
    int8 panels 2.3-3.6x lamina's float32 panels, and MKL's bfloat16 LSTM at 0.7x its float32
    speed; lamina's portable int8 kernel (the baseline build, or a CPU without AVX2) is plain
    integer code. LAMINA_LOW_PRECISION forces one."""
    forced = os.environ.get("LAMINA_LOW_PRECISION")
    if forced:
        return check_low_precision(forced, "LAMINA_LOW_PRECISION")
    from .compiled import PATH, _kernels
    if PATH == "amx":
        return "lamina"
    if cpu_vendor() == "GenuineIntel" and built("mkl"):
        return "mkl"
    return "lamina" if _kernels.int8_uses_avx2() else "float32"


LOW_PRECISION_PATHS = ("mkl", "lamina", "float32")


def check_low_precision(name, where):
    from ...errors import SettingError
    if name not in LOW_PRECISION_PATHS:
        raise SettingError(f"{where}: expected one of {', '.join(map(repr, LOW_PRECISION_PATHS))}, found {name!r}")
    if name == "mkl" and not built("mkl"):
        raise SettingError(f"{where}: 'mkl' needs MKL, which this installation was built without; use 'lamina' "
                           f"or 'float32'")
    return name


def provider(name, where="BLAS provider"):
    _check(name, where)
    load_library(name)
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
