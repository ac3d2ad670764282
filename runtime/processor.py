"""What this machine's CPU is and can do, read once from /proc/cpuinfo: its model name, its
vendor, and the instruction sets lamina's kernels and BLAS care about (AVX2 and FMA; AVX-512 and
its bfloat16 and VNNI forms; AMX). Elsewhere (no /proc/cpuinfo) the names are the platform's and
the sets are unknown (empty)."""
from __future__ import annotations

import functools
import platform

# the instruction sets that decide a kernel's path, lowest first, as /proc/cpuinfo names them
INSTRUCTION_SETS = ("sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512dq", "avx512cd", "avx512vl",
                    "avx512_vnni", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def _fields() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo ({} where it cannot be read)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block ends
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def model_name() -> str:
    return _fields().get("model name") or platform.processor() or platform.machine()


def vendor() -> str:
    return _fields().get("vendor_id", "unknown")


def instruction_sets() -> list[str]:
    """The instruction sets of INSTRUCTION_SETS this CPU has, in that order."""
    flags = set(_fields().get("flags", "").split())
    return [name for name in INSTRUCTION_SETS if name in flags]


def describe() -> dict[str, object]:
    """The CPU as a benchmark's results record it: model, vendor, instruction sets, cores."""
    import os
    return {"model": model_name(), "vendor": vendor(), "instruction_sets": instruction_sets(),
            "cores": os.cpu_count(), "usable_cores": len(os.sched_getaffinity(0))}
