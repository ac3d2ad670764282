"""Each composed operation a backend overrides (lamina.backends.base: everything outside
CORE_KERNELS), timed against the composed form on the same backend, same arrays, one process:
the measurement that keeps an override. A ratio above 1 means the override is faster.

`python -m bench overrides` prints the table; with --json the rows go under "overrides". The
convolution and recurrence overrides are whole algorithms; bench conv and bench rnn measure them.
"""
import copy
import statistics
import time

import numpy as np

# composed operations that choose an algorithm or state a policy rather than compute: measured by
# their own suites (conv, rnn) or not timed at all
NOT_TIMED = {"conv_algorithms", "conv_forward", "conv_backward", "recurrence_forward", "recurrence_backward",
             "sample_threads", "packs_fixed_weights", "activate_in_place", "zeros", "scratch", "arange", "ones"}


def _cases(be, plain, rng):
    """name -> (args builder, description): the arrays of one typical call of each operation."""
    f32 = np.float32

    def arr(*shape):
        return be.from_host(rng.standard_normal(shape).astype(f32))

    def ints(values):
        return np.ascontiguousarray(values, dtype=np.int32)

    rows = ints(np.sort(rng.choice(50_000, 1000, replace=False)))
    labels = ints(rng.integers(0, 1000, 512))
    weight, packed = arr(256, 1024), {}

    def pack_for(impl):
        if impl not in packed:
            packed[impl] = impl.pack(plain if impl is not type(be) else be, weight, max_rows=64)
        return packed[impl]

    return {
        "gemm_bias": (lambda impl: (arr(256, 512), arr(512, 1024), arr(256, 1024), arr(1024)), "256x512 @ 512x1024"),
        "pack": (lambda impl: (weight,), "256x1024"),
        "packed_gemm": (lambda impl: (arr(64, 256), pack_for(impl), arr(64, 1024)), "64x256 @ packed 256x1024"),
        "packed_gemm_bias": (lambda impl: (arr(64, 256), pack_for(impl), arr(64, 1024), arr(1024)),
                             "64x256 @ packed 256x1024"),
        "add_bias": (lambda impl: (arr(4096, 256), arr(256)), "4096x256"),
        "bias_grad": (lambda impl: (arr(4096, 256), arr(256)), "4096x256"),
        "copy_to_columns": (lambda impl: (arr(4096, 128), arr(4096, 512), 128), "4096x128 into 4096x512"),
        "copy_from_columns": (lambda impl: (arr(4096, 512), 128, arr(4096, 128)), "4096x128 of 4096x512"),
        "fill_rows": (lambda impl: (arr(50_000, 128), rows, 0.0), "1000 of 50000x128"),
        "sgd_update_rows": (lambda impl: (arr(50_000, 128), arr(50_000, 128), arr(50_000, 128), rows, 0.1, 0.9),
                            "1000 of 50000x128, momentum"),
        "adam_update_rows": (lambda impl: (arr(50_000, 128), arr(50_000, 128), arr(50_000, 128),
                                           be.from_host(np.abs(rng.standard_normal((50_000, 128))).astype(f32)),
                                           rows, 1e-3, 0.9, 0.999, 1e-8, 3), "1000 of 50000x128"),
        "adagrad_update_rows": (lambda impl: (arr(50_000, 128), arr(50_000, 128),
                                              be.from_host(np.abs(rng.standard_normal((50_000, 128))).astype(f32)),
                                              rows, 0.1, 1e-8), "1000 of 50000x128"),
        "add_selected_bias": (lambda impl: (arr(12_800), arr(50_000), ints(rng.integers(0, 50_000, 12_800))),
                              "12800 entries"),
        "softmax_cross_entropy": (lambda impl: (arr(512, 1000), labels, None, arr(512, 1000), arr(512)),
                                  "512x1000"),
        "softmax_cross_entropy_backward": (lambda impl: (arr(512, 1000), labels, None, arr(512), arr(512, 1000)),
                                           "512x1000"),
        "square_error": (lambda impl: (arr(512, 256), arr(512, 256), None, arr(512)), "512x256"),
        "square_error_backward": (lambda impl: (arr(512, 256), arr(512, 256), None, arr(512), arr(512, 256)),
                                  "512x256"),
        "bce_with_logits": (lambda impl: (arr(512, 256), arr(512, 256), None, arr(512)), "512x256"),
        "bce_with_logits_backward": (lambda impl: (arr(512, 256), arr(512, 256), None, arr(512), arr(512, 256)),
                                     "512x256"),
    }


def _time(be, fn, args, rounds):
    finish = getattr(getattr(be, "queue", None), "finish", lambda: None)
    fn(be, *args)  # warm-up: scratch buffers, kernel builds, packs
    finish()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        fn(be, *args)
        finish()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def overridden(backend_class):
    """The composed operations backend_class overrides."""
    from lamina.backends.base import CORE_KERNELS, Backend
    return sorted(name for name, value in vars(Backend).items() if callable(value) and not name.startswith("_")
                  and name not in CORE_KERNELS and getattr(backend_class, name) is not value)


def backends():
    import lamina as lm
    found = [("cpu", lm.CPUBackend())]
    try:
        from lamina.backends.opencl import OpenCLBackend, devices
        found += [(f"opencl:{i}", OpenCLBackend(i)) for i in range(len(devices()))]
    except Exception:  # (no pyopencl, or no device: the CPU alone)
        pass
    return found


def composed_only(be):
    """The same backend object (its context, queue, arrays) with every composed operation
    Backend's own: what it would run without its overrides."""
    from lamina.backends.base import Backend
    names = overridden(type(be))
    plain = copy.copy(be)
    plain.__class__ = type(f"Composed{type(be).__name__}", (type(be),), {n: getattr(Backend, n) for n in names})
    return plain


def run(rounds=5, only=None):
    rows = []
    for device, be in backends():
        plain = composed_only(be)
        cases = _cases(be, plain, np.random.default_rng(0))
        for name in overridden(type(be)):
            if name in NOT_TIMED or (only and only not in name):
                continue
            build, shape = cases[name]
            t_own = _time(be, getattr(type(be), name), build(type(be)), max(rounds, 5) * 4)
            t_composed = _time(plain, getattr(type(plain), name), build(type(plain)), max(rounds, 5) * 4)
            rows.append({"device": device, "operation": name, "shape": shape, "override_ms": 1e3 * t_own,
                         "composed_ms": 1e3 * t_composed, "ratio": t_composed / t_own})
    print(f"\n{'device':<10} {'operation':<32} {'shape':<28} {'override ms':>12} {'composed ms':>12} {'ratio':>7}")
    for r in rows:
        print(f"{r['device']:<10} {r['operation']:<32} {r['shape']:<28} {r['override_ms']:>12.3f} "
              f"{r['composed_ms']:>12.3f} {r['ratio']:>7.2f}")
    untimed = {device: [n for n in overridden(type(be)) if n in NOT_TIMED] for device, be in backends()}
    print("\nnot timed here (algorithms and policies; bench conv and bench rnn measure the algorithms): "
          + "; ".join(f"{d}: {', '.join(n)}" for d, n in untimed.items()))
    return {"overrides": rows}
