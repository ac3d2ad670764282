"""The CPU backend's compiled kernels for the instruction-set path this process takes.

The kernels (`_kernels`, `_selective`) are built twice from the same sources: with the hot row,
cell, volume and convolution loops cloned for x86-64-v3 (AVX2 + FMA) beside the baseline, the
loader running the clone the CPU supports; and as `_kernels_baseline`/`_selective_baseline`, the
baseline alone. `LAMINA_ISA` picks the path:
- `auto` (the default) and `avx2`: the cloned build (avx2 refuses a CPU without AVX2 and FMA);
- `baseline`: the baseline build, on any x86-64 CPU.
So every path is tested on every machine that has it, by forcing the lower ones.
"""
from __future__ import annotations

import importlib
import os

from ...errors import SettingError
from ...processor import instruction_sets

PATHS = ("auto", "avx2", "baseline")


def chosen_path() -> str:
    """The path LAMINA_ISA asks for, checked against this CPU ('auto' resolved)."""
    asked = os.environ.get("LAMINA_ISA", "auto") or "auto"
    if asked not in PATHS:
        raise SettingError(f"LAMINA_ISA: expected one of {', '.join(PATHS)}, found {asked!r}")
    found = set(instruction_sets())
    has_avx2 = {"avx2", "fma"} <= found
    if asked == "avx2" and not has_avx2:
        raise SettingError(f"LAMINA_ISA=avx2: this CPU lacks {', '.join(sorted({'avx2', 'fma'} - found))}")
    if asked == "auto":
        return "avx2" if has_avx2 else "baseline"
    return asked


try:
    PATH = chosen_path()
except SettingError:  # raised again by lamina.threads.check_environment (the first network made)
    PATH = "baseline"
_suffix = "_baseline" if PATH == "baseline" else ""
_kernels = importlib.import_module(f"lamina.backends.cpu._kernels{_suffix}")
_selective = importlib.import_module(f"lamina.backends.cpu._selective{_suffix}")


def describe() -> dict[str, str]:
    """{kernel family: the path it takes}, for `lamina devices`."""
    row = ("AVX2 + FMA clones (x86-64-v3)" if PATH == "avx2" else "baseline (x86-64)") + \
        (" (forced by LAMINA_ISA)" if os.environ.get("LAMINA_ISA", "auto") not in ("", "auto") else "")
    return {"row, cell, pool and volume kernels": row, "direct and Winograd convolutions": row,
            "panel GEMM (the fused recurrence)": row, "selective rows": row}
