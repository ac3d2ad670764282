"""Timing, machine peak and reporting shared by every suite.

Each implementation (lamina, torch, raw MKL sgemm, raw OpenBLAS sgemm…) runs in a worker process
of its own, so their thread pools and OpenMP runtimes never share a process. The parent makes the
workers take turns (round-robin, after a warm-up), so drifting clocks and noisy neighbours hit
them alike. In a turn a worker times consecutive calls for about `turn_seconds`; between turns the
parent waits `settle` seconds, because on a 2-core machine the previous worker's idle BLAS threads
keep spinning for a while (OpenBLAS's for up to ~0.1 s) and would take the cores from the next.
Each implementation reports the median and minimum over all its calls.

A case is (implementation, factory, args): `factory` is "module:function", called in the worker
as function(*args) and returning the callable to time.
"""
import glob
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Per-implementation environment. Raw MKL threads through libgomp; importing lamina (for its MKL
# binding) on a machine where OpenBLAS is the default would make libgomp's workers passive, so this
# worker restores libgomp's own default: spin 300,000 rounds, then sleep (GOMP_SPINCOUNT
# overrides OMP_WAIT_POLICY). Never ACTIVE: idle workers would then spin forever and take the
# cores from whichever implementation runs next.
IMPL_ENV = {"mkl-sgemm": {"GOMP_SPINCOUNT": "300000"}, "mkl-peak": {"GOMP_SPINCOUNT": "300000"}}


def _built(impls):
    """The entries of impls whose provider this lamina was built with (MKL is optional). Found from
    the package's files: importing lamina here would set its OpenMP environment for every worker."""
    spec = importlib.util.find_spec("lamina")
    folders = list(spec.submodule_search_locations or []) if spec else []
    return {impl: name for impl, name in impls.items()
            if any(glob.glob(os.path.join(folder, "backends", "cpu", f"_{name}.*")) for folder in folders)}


RAW_GEMM = _built({"mkl-sgemm": "mkl", "openblas-sgemm": "openblas"})
# The machine's peak: a large square sgemm from each provider. A case can time these in its own
# rounds, so that its "% peak" divides by the throughput of the same minutes (a shared VM's speed
# moves by up to 2x within minutes, which one peak measured at the start cannot follow).
PEAK_GEMM = _built({"mkl-peak": "mkl", "openblas-peak": "openblas"})
PEAK_SIZE = 2048


@dataclass
class Row:
    suite: str
    case: str
    impl: str
    threads: int
    ms_median: float
    ms_min: float
    gflops: float | None
    algorithm: str | None = None  # how lamina ran the case, where the suite says
    host_us_per_step: float | None = None  # OpenCL recurrences: host time per time step (bench.opencl)
    transfers_per_step: dict | None = None  # OpenCL: host <-> device transfers per call (bench.opencl)


class Worker:
    """A process that builds one callable at a time and times single calls on request."""

    def __init__(self, impl):
        self.impl = impl
        path = [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        env = {**os.environ, **IMPL_ENV.get(impl, {}), "PYTHONPATH": os.pathsep.join(path)}
        self.proc = subprocess.Popen([sys.executable, "-m", "bench.worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT)

    def ask(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"bench worker for {self.impl} died")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"bench worker for {self.impl}: {reply['error']}")
        return reply

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


class Bench:
    """The workers of one run, one per implementation, reused across cases."""

    def __init__(self, only=None):
        self.workers = {}
        self.only = only  # run only the cases whose name contains this text

    def worker(self, impl):
        if impl not in self.workers:
            self.workers[impl] = Worker(impl)
        return self.workers[impl]

    def close(self):
        for w in self.workers.values():
            w.close()

    def time_case(self, suite, case, threads, impls, flops, rounds=5, warmup=2, turn_seconds=0.04,
                  settle=0.12, with_peak=False):
        """impls: {impl: (factory, args)}. Returns one Row per implementation. with_peak: the
        square sgemms of PEAK_GEMM take turns with the implementations (rows "mkl-peak",
        "openblas-peak"), and the table's "% peak" of this case divides by the faster of them."""
        if self.only and suite != "peak" and self.only not in case:
            return []
        if with_peak:
            impls = {**impls, **_peak_impls()}
        for impl, (factory, args) in list(impls.items()):
            try:
                self.worker(impl).ask(cmd="setup", threads=threads, factory=factory, args=args, warmup=warmup)
            except RuntimeError as error:
                if impl.startswith("lamina"):
                    raise
                # a peer without a path for this CPU (PyTorch's bfloat16 LSTM needs AVX-512):
                # the case runs without it and says so
                print(f"  {suite} {case}: {impl} left out, it cannot run here: "
                      f"{str(error).strip().splitlines()[-1]}", file=sys.stderr)
                del impls[impl]
        times = {impl: [] for impl in impls}
        for _ in range(rounds):
            for impl in impls:
                time.sleep(settle)
                times[impl] += self.worker(impl).ask(cmd="time", seconds=turn_seconds)["seconds"]
        rows = []
        for impl, ts in times.items():
            med = statistics.median(ts)
            work = 2.0 * PEAK_SIZE ** 3 if impl in PEAK_GEMM and suite != "peak" else flops
            report = self.worker(impl).ask(cmd="report")  # what the timed callable says of itself
            rows.append(Row(suite, case, impl, threads, med * 1e3, min(ts) * 1e3,
                            work / med / 1e9 if work else None,
                            **{k: v for k, v in report.items() if k in Row.__dataclass_fields__}))
        return rows

    def peak(self, threads, size=PEAK_SIZE, repeats=4):
        """The machine's sgemm throughput at this thread count: the faster of MKL and OpenBLAS on
        a large square product. Returns (GFLOP/s, rows)."""
        rows = self.time_case("peak", f"sgemm {size}x{size}x{size}", threads, _peak_impls(size),
                              2.0 * size ** 3, rounds=repeats, warmup=1, turn_seconds=0)
        return max(r.gflops for r in rows), rows


def _peak_impls(size=PEAK_SIZE):
    return {impl: ("bench.harness:square_gemm", [name, size]) for impl, name in PEAK_GEMM.items()}


def _best_gflops(row):
    """A row's GFLOP/s from its fastest call (its `gflops` is from the median)."""
    return row.gflops * row.ms_median / row.ms_min


def _peak_gflops(rows, best=False):
    """The faster provider's GFLOP/s from its median call, or from its best call."""
    if not rows:
        return None
    return max(_best_gflops(r) if best else r.gflops for r in rows)


# ---------------------------------------------------------------- helpers run inside workers

def lamina_step(net, feeds, grads, mode, device="cpu"):
    """What a lamina case times: a forward in inference mode ('fwd'/'infer'), or a training step
    ('fwd+bwd'/'train'): forward, backward from the given output gradients, weight gradients.
    On an OpenCL device ('opencl:N') the network moves there and each call waits for the queue."""
    outputs = list(grads)
    if device != "cpu":
        net.to(device)
    done = net.backend.queue.finish if device != "cpu" else (lambda: None)

    def forward():
        net.forward(feeds, training=False)
        done()

    def forward_backward():
        net.forward(feeds, training=True, grad_outputs=outputs)
        net.backward(grad_outputs=grads)
        net.zero_grad()
        done()
    step = forward if mode in ("fwd", "infer") else forward_backward
    step.net = net
    return step


_raw_providers = []  # the BLAS providers this worker times raw


def set_threads(n):
    """Set the thread count of whatever this worker has imported; a BLAS timed raw runs on its
    own n threads (inside lamina, OpenBLAS runs on one and lamina splits the GEMM)."""
    if "lamina" in sys.modules:
        sys.modules["lamina"].set_num_threads(n)
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)
    for p in _raw_providers:
        p.set_num_threads(n)


def raw_provider(name):
    from lamina.backends.cpu.blas import provider
    p = provider(name)
    _raw_providers.append(p)
    return p


def square_gemm(provider_name, size):
    import numpy as np
    p = raw_provider(provider_name)
    rng = np.random.default_rng(0)
    a = rng.standard_normal((size, size)).astype(np.float32)
    b = rng.standard_normal((size, size)).astype(np.float32)
    c = np.empty_like(a)
    return lambda: p.gemm(a, b, c, False, False, 1.0, 0.0)


# ---------------------------------------------------------------- reporting

def print_table(rows, peaks, file=None):
    """One line per case and peer: lamina's time, the peer's, the speedup (peer / lamina),
    lamina's GFLOP/s and fraction of peak (the peak timed in the case's own rounds where it was,
    else `peaks`, measured once per thread count), and the best raw sgemm time for the same GEMMs.
    Where the case timed its own peak, "best" is the same fraction from the best calls of each
    (lamina's fastest call against the sgemm's fastest): on a shared VM whole turns run 20-25%
    slower at times, and the two medians need not sample those turns alike."""
    cases = {}
    for r in rows:
        cases.setdefault((r.suite, r.case, r.threads), {})[r.impl] = r
    head = (f"{'suite':<6} {'case':<34} {'thr':>3} {'lamina ms':>10} {'peer':<15} {'peer ms':>9} "
            f"{'speedup':>8} {'GFLOP/s':>8} {'peak':>6} {'% peak':>7} {'best':>6} {'raw ms':>8} {'% raw':>6}"
            + ("  algorithm" if any(r.algorithm for r in rows) else ""))
    print(head, file=file)
    print("-" * len(head), file=file)
    for (suite, case, threads), impls in cases.items():
        own_peak = [r for i, r in impls.items() if i in PEAK_GEMM and suite != "peak"]
        peak = _peak_gflops(own_peak) or peaks.get(threads)
        best_peak = _peak_gflops(own_peak, best=True)
        ours = impls.get("lamina")
        raw = [r for i, r in impls.items() if i in RAW_GEMM]
        best_raw = min(raw, key=lambda r: r.ms_median) if raw else None
        if suite == "peak":
            peers = [r for i, r in impls.items() if i in PEAK_GEMM]
        else:
            peers = [r for i, r in impls.items() if i != "lamina" and i not in PEAK_GEMM and
                     (ours is None or i not in RAW_GEMM)]
        for peer in peers or [None]:
            subject = ours or peer
            frac = f"{100 * subject.gflops / peak:6.1f}%" if peak and subject.gflops else ""
            best = f"{100 * _best_gflops(subject) / best_peak:5.1f}%" if best_peak and subject.gflops else ""
            speed = f"{peer.ms_median / ours.ms_median:7.2f}x" if ours and peer else ""
            raw_ms = f"{best_raw.ms_median:8.3f}" if best_raw and ours else ""
            of_raw = f"{100 * best_raw.ms_median / ours.ms_median:5.1f}%" if best_raw and ours else ""
            print(f"{suite:<6} {case:<34} {threads:>3} {(ours.ms_median if ours else 0):>10.3f} "
                  f"{(peer.impl if peer else '-'):<15} {(peer.ms_median if peer else float('nan')):>9.3f} "
                  f"{speed:>8} {subject.gflops or 0:>8.1f} {peak or 0:>6.0f} {frac:>7} {best:>6} {raw_ms:>8} {of_raw:>6}"
                  + (f"  {ours.algorithm}" if ours and ours.algorithm else ""), file=file)


def write_json(path, rows, peaks, extra=None):
    """The rows and peaks, and the results of suites with their own tables (`extra`), with the
    CPU they ran on (model, instruction sets, cores): a ratio is a fact of its machine."""
    from lamina.processor import describe
    with open(path, "w") as f:
        json.dump({"cpu": describe(), "peak_gflops": {str(t): p for t, p in peaks.items()},
                   "rows": [asdict(r) for r in rows], **(extra or {})}, f, indent=1)
