"""Suite `opencl`: lamina's OpenCL backend on every OpenCL device here (rows `lamina-opencl`),
beside the CPU backend measured in the same run (rows `lamina-cpu`):
- the GEMM kernel alone, square n = 256, 512, 1024;
- a fully-connected network, forward and forward+backward, batch 256, 1024 -> 1024 -> 1024 -> 10;
- the cases of the other suites: LSTM 256 (rnn), conv case C (conv), the per-row selection of
  500 columns over 50 000 classes (selective), inference and training;
- a training step of each shipped model (python_lm, denoise3d, line_kind).

Every OpenCL row also gives `transfers_per_step`: the host <-> device transfers (to_device,
to_host, bytes) per timed call, from the backend's counters (every transfer the backend makes goes
through from_host / to_host); and each recurrent row `host_us_per_step`: the CPU time of the
calling thread in the recurrences' calls (enqueueing, and recording the steps' plans) per time
step walked (CPU time: on a CPU device the driver's threads run the kernels on the same cores, and
the wall time of the calling thread would count the time it waits for a core)."""
import time

import numpy as np

from .harness import lamina_step


class Audited:
    """A step of a network on an OpenCL device whose report() gives the host time of its
    recurrences per time step and its transfers per call (see the module docstring)."""

    def __init__(self, step):
        self.step, self.be = step, step.net.backend
        self.reset()
        for name in ("recurrence_forward", "recurrence_backward"):
            setattr(self.be, name, self._timed(getattr(self.be, name)))

    def reset(self):
        self.calls, self.host, self.time_steps = 0, 0.0, 0
        self.start = dict(self.be.transfers)

    def _timed(self, method):
        def timed(cell, ctx, run):
            t0 = time.thread_time()
            method(cell, ctx, run)
            self.host += time.thread_time() - t0
            self.time_steps += ctx.order.steps
        return timed

    def __call__(self):
        self.step()
        self.calls += 1

    def report(self):
        calls = max(self.calls, 1)
        return {"host_us_per_step": 1e6 * self.host / self.time_steps if self.time_steps else None,
                "transfers_per_step": {k: (v - self.start[k]) / calls for k, v in self.be.transfers.items()}}


def recurrent_case(kind, mode, size, device):
    from .rnn import lamina_rnn
    step = lamina_rnn(kind, mode, size, device)
    return Audited(step) if device != "cpu" else step


def _shipped_feeds(name, net):
    from pathlib import Path
    from lamina.zoo import denoise, language, lines
    rng = np.random.default_rng(0)
    if name == "denoise3d":
        clean = denoise.shapes(4, rng)
        return {"noisy": denoise.noisy_copy(clean, rng), "clean": clean}
    source = (Path(np.__file__).parent / "_core" / "fromnumeric.py").read_text()
    tok = language.tokenizer(net)
    if name == "python_lm":
        return language.training_feeds(net, language.chunk(tok.encode(source), 48)[:32], 16, rng)
    labelled = lines.labelled_lines([source])[:64]
    return lines.feeds(lines.encode(tok, [line for line, _ in labelled]), [kind for _, kind in labelled])


def shipped_case(name, device):
    """A training step (forward, backward, zeroed gradients) of a shipped model."""
    from pathlib import Path
    import lamina as lm
    net = lm.load(Path(__file__).resolve().parent.parent / "models" / name / "model.lamina")
    feeds = _shipped_feeds(name, net)
    if device != "cpu":
        net.to(device)
    done = net.backend.queue.finish if device != "cpu" else (lambda: None)

    def step():
        net.forward(feeds, training=True, outputs=net.cost_outputs())
        net.backward()
        net.zero_grad()
        done()
    step.net = net
    return Audited(step) if device != "cpu" else step

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
        for name, factory, args in (("lstm 256 infer", "bench.opencl:recurrent_case", ["lstm", "infer", 256]),
                                    ("lstm 256 train", "bench.opencl:recurrent_case", ["lstm", "train", 256]),
                                    ("gru 256 train", "bench.opencl:recurrent_case", ["gru", "train", 256]),
                                    ("python_lm train step", "bench.opencl:shipped_case", ["python_lm"]),
                                    ("denoise3d train step", "bench.opencl:shipped_case", ["denoise3d"]),
                                    ("line_kind train step", "bench.opencl:shipped_case", ["line_kind"]),
                                    ("conv C fwd", "bench.conv:lamina_conv", ["C", "fwd"]),
                                    ("conv C fwd+bwd", "bench.conv:lamina_conv", ["C", "fwd+bwd"]),
                                    ("selective per-row fwd", "bench.selective:lamina_selective", ["fwd", "per-row"]),
                                    ("selective per-row fwd+bwd", "bench.selective:lamina_selective",
                                     ["fwd+bwd", "per-row"])):
            extra = [500, "auto"] if "selective" in factory else []
            impls = {"lamina-opencl": (factory, args + extra + [device]), "lamina-cpu": (factory, args + extra + ["cpu"])}
            rows += bench.time_case("opencl", f"{device} {name}", threads, impls, None, max(2, rounds // 2))
    return rows
