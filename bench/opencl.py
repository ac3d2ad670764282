"""Suite `opencl`: lamina's OpenCL backend on every OpenCL device here (rows `lamina-opencl`),
beside the CPU backend measured in the same run (rows `lamina-cpu`):
- the GEMM kernel alone, square n = 256, 512, 1024;
- a fully-connected network, forward and forward+backward, batch 256, 1024 -> 1024 -> 1024 -> 10;
- the cases of the other suites: LSTM 256 (rnn), conv case C (conv), the per-row selection of
  500 columns over 50 000 classes (selective), inference and training."""
import numpy as np

from .harness import lamina_step

SQUARE = [256, 512, 1024]


def _device_count():
    try:
        from lamina.backends.opencl import devices
        return len(devices())
    except Exception:
        return 0


def gemm_case(device, n):
    from lamina.backends import get_backend
    be = get_backend(device)
    rng = np.random.default_rng(0)
    a = be.from_host(rng.standard_normal((n, n)).astype(np.float32))
    c = be.empty((n, n), np.float32)

    def call():
        be.gemm(a, a, c)
        if device != "cpu":
            be.queue.finish()
    return call


def mlp_case(device, mode):
    import lamina as lm
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", 1024)
    h = lm.layers.Linear(1024, 1024, activation="relu")(x)
    h = lm.layers.Linear(1024, 1024, activation="relu")(h)
    net.outputs(y=lm.layers.Linear(1024, 10)(h))
    if device != "cpu":
        net.to(device)
    rng = np.random.default_rng(1)
    step = lamina_step(net, {"x": rng.standard_normal((256, 1024)).astype(np.float32)},
                       {"y": rng.standard_normal((256, 10)).astype(np.float32)}, mode)
    if device == "cpu":
        return step

    def call():
        step()
        net.backend.queue.finish()
    return call


def run(bench, threads, rounds, have_torch):
    rows = []
    for index in range(_device_count()):
        device = f"opencl:{index}"
        for n in SQUARE:
            impls = {"lamina-opencl": ("bench.opencl:gemm_case", [device, n]),
                     "lamina-cpu": ("bench.opencl:gemm_case", ["cpu", n])}
            rows += bench.time_case("opencl", f"{device} gemm {n}", threads, impls, 2.0 * n ** 3, rounds)
        flops = 2.0 * 256 * (1024 * 1024 * 2 + 1024 * 10)
        for mode, mult in (("fwd", 1), ("fwd+bwd", 3)):
            impls = {"lamina-opencl": ("bench.opencl:mlp_case", [device, mode]),
                     "lamina-cpu": ("bench.opencl:mlp_case", ["cpu", mode])}
            rows += bench.time_case("opencl", f"{device} mlp {mode} b256", threads, impls, mult * flops, rounds)
        for name, factory, args in (("lstm 256 infer", "bench.rnn:lamina_rnn", ["lstm", "infer", 256]),
                                    ("lstm 256 train", "bench.rnn:lamina_rnn", ["lstm", "train", 256]),
                                    ("conv C fwd", "bench.conv:lamina_conv", ["C", "fwd"]),
                                    ("conv C fwd+bwd", "bench.conv:lamina_conv", ["C", "fwd+bwd"]),
                                    ("selective per-row fwd", "bench.selective:lamina_selective", ["fwd", "per-row"]),
                                    ("selective per-row fwd+bwd", "bench.selective:lamina_selective",
                                     ["fwd+bwd", "per-row"])):
            extra = [500, "auto"] if "selective" in factory else []
            impls = {"lamina-opencl": (factory, args + extra + [device]), "lamina-cpu": (factory, args + extra + ["cpu"])}
            rows += bench.time_case("opencl", f"{device} {name}", threads, impls, None, max(2, rounds // 2))
    return rows
