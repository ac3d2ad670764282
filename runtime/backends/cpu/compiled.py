"""The CPU backend's compiled kernels for the instruction-set path this process takes.

The kernels (`_kernels`, `_selective`) are built three times from the same sources: with the hot
row, cell, volume and convolution loops cloned for x86-64-v3 (AVX2 + FMA) beside the baseline, the
loader running the clone the CPU supports; as `_kernels_avx512`/`_selective_avx512`, the same
loops compiled for x86-64-v4 (AVX-512 F/BW/DQ/CD/VL) alone, where the loops the compiler
vectorises run 16 floats wide (the rest of those modules is baseline code, so they import on any
x86-64 CPU; their hot loops run only where it has AVX-512), with AMX tiles for the int8 and
bfloat16 panel products; and as `_kernels_baseline`/`_selective_baseline`, the baseline alone.
`LAMINA_ISA` picks the path:
- `auto` (the default): the widest this CPU runs;
- `amx`: the AVX-512 build with its int8 and bfloat16 panel products on AMX tiles (refused on a
  CPU without AMX-TILE, AMX-BF16 and AMX-INT8, or where the OS does not hand out the tiles' state:
  Linux before 5.16);
- `avx512`: the AVX-512 build (refused on a CPU without those sets), its panel products on
  AVX512-BF16 and VNNI vectors;
- `avx2`: the cloned build (refused on a CPU without AVX2 and FMA);
- `baseline`: the baseline build, on any x86-64 CPU.
So every path is tested on every machine that has it, by forcing the lower ones.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

from ...errors import SettingError
from ...processor import instruction_sets

PATHS = ("auto", "amx", "avx512", "avx2", "baseline")
# the instruction sets each path needs, and the suffix of its modules
_AVX512 = {"avx2", "fma", "avx512f", "avx512bw", "avx512dq", "avx512cd", "avx512vl"}
NEEDS = {"amx": _AVX512 | {"avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16", "amx_int8"},
         "avx512": _AVX512, "avx2": {"avx2", "fma"}, "baseline": set()}
SUFFIX = {"amx": "_avx512", "avx512": "_avx512", "avx2": "", "baseline": "_baseline"}
LABEL = {"amx": "AVX-512 (x86-64-v4)", "avx512": "AVX-512 (x86-64-v4)", "avx2": "AVX2 + FMA clones (x86-64-v3)",
         "baseline": "baseline (x86-64)"}


def _built(path: str) -> bool:
    return importlib.util.find_spec(f"lamina.backends.cpu._kernels{SUFFIX[path]}") is not None


def chosen_path() -> str:
    """The path LAMINA_ISA asks for, checked against this CPU and this build ('auto' resolved)."""
    asked = os.environ.get("LAMINA_ISA", "auto") or "auto"
    if asked not in PATHS:
        raise SettingError(f"LAMINA_ISA: expected one of {', '.join(PATHS)}, found {asked!r}")
    found = set(instruction_sets())
    if asked == "auto":
        return next(path for path in PATHS[1:] if NEEDS[path] <= found and _built(path))
    if not NEEDS[asked] <= found:
        raise SettingError(f"LAMINA_ISA={asked}: this CPU lacks {', '.join(sorted(NEEDS[asked] - found))}")
    if not _built(asked):
        raise SettingError(f"LAMINA_ISA={asked}: this installation has no {asked} build (it is built on x86-64 only)")
    if asked == "amx" and _tiles_refused:
        raise SettingError("LAMINA_ISA=amx: the OS does not hand this process the AMX tiles' state "
                           "(arch_prctl ARCH_REQ_XCOMP_PERM: Linux 5.16 or later)")
    return asked


_tiles_refused = False
try:
    PATH = chosen_path()
except SettingError:  # raised again by lamina.threads.check_environment (the first network made)
    PATH = "baseline"
_kernels = importlib.import_module(f"lamina.backends.cpu._kernels{SUFFIX[PATH]}")
_selective = importlib.import_module(f"lamina.backends.cpu._selective{SUFFIX[PATH]}")
if PATH == "amx" and not _kernels.amx_enable():  # (before any panel is packed: they pad to whole tiles)
    _tiles_refused, PATH = True, "avx512"


def describe() -> dict[str, str]:
    """{kernel family: the path it takes}, for `lamina devices`."""
    row = LABEL[PATH] + (" (forced by LAMINA_ISA)" if os.environ.get("LAMINA_ISA", "auto") not in ("", "auto") else "")
    return {"row, cell, pool and volume kernels": row, "direct and Winograd convolutions": row,
            "panel GEMM (the fused recurrence)": row, "selective rows": row,
            "int8 and bfloat16 panels": "AMX tiles" if PATH == "amx" else
            row + (" (AMX refused by the OS)" if _tiles_refused else "")}
