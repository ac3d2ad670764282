"""Bounded memory: training on batches whose shapes vary (as real sequence data does) reaches a
steady state and stays there. Buffers are sized by capacity, not cached per shape, and nothing
needs the cycle collector: the loops run with it switched off."""
import gc
import os

import numpy as np
import pytest

import lamina as lm
from lamina.layers import LSTM, Embedding, Linear, SoftmaxCrossEntropy

from conftest import BLAS_PROVIDERS, NO_OPENCL, OPENCL_DEVICES, stable_rng


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def varying_batches(count, seed=0):
    """Batches of 1-64 sequences of lengths 1-49."""
    rng = stable_rng("memory", seed)
    for _ in range(count):
        lengths = rng.integers(1, 50, size=int(rng.integers(1, 65)))
        total = int(lengths.sum())
        starts = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=starts[1:])
        yield {"ids": lm.Sequences(rng.integers(0, 50, total).astype(np.int32), starts),
               "y": lm.Sequences(rng.integers(0, 50, total).astype(np.int32), starts)}


def language_model():
    net = lm.Network()
    ids, y = net.input("ids", dtype="int32", sequence=True), net.input("y", dtype="int32", sequence=True)
    logits = Linear(32, 50)(LSTM(16, 32)(Embedding(50, 16)(ids))[0])
    net.outputs(loss=SoftmaxCrossEntropy()(logits, y), logits=logits)
    return net


def growth_after_warmup(net, steps, warmup, run_every=7):
    """RSS growth (bytes) between the end of the warm-up and the last step, training on varying
    shapes with an inference run now and then; the cycle collector stays off throughout."""
    opt = lm.optim.Adam(net, lr=1e-3)
    gc.collect()
    gc.disable()
    try:
        for step, feeds in enumerate(varying_batches(steps)):
            net.train_step(feeds, opt)
            if step % run_every == 0:
                net.run({"ids": feeds["ids"]})
            if step == warmup:
                steady = rss_bytes()
        return rss_bytes() - steady
    finally:
        gc.enable()


def test_varying_shapes_stay_within_a_fixed_bound_on_the_cpu():
    growth = growth_after_warmup(language_model(), steps=2000, warmup=400)
    assert growth < 8 << 20, f"RSS grew by {growth / 2**20:.1f} MiB after the warm-up"


@pytest.mark.skipif(not OPENCL_DEVICES, reason=NO_OPENCL)
@pytest.mark.slow
def test_varying_shapes_stay_within_a_fixed_bound_on_opencl():
    growth = growth_after_warmup(language_model().to("opencl"), steps=2000, warmup=400)
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB after the warm-up"


def test_dropped_networks_are_freed_without_the_cycle_collector():
    """A network that goes out of scope takes its buffers with it at once."""
    feeds = next(varying_batches(1, seed=3))
    gc.collect()
    gc.disable()
    try:
        before = rss_bytes()
        for _ in range(30):
            net = language_model()
            net.train_step(feeds, lm.optim.SGD(net, lr=0.1))
            net.run({"ids": feeds["ids"]})
            del net
        growth = rss_bytes() - before
    finally:
        gc.enable()
    assert growth < 16 << 20, f"RSS grew by {growth / 2**20:.1f} MiB over 30 dropped networks"


def test_a_run_keeps_no_reference_to_the_callers_arrays():
    import weakref
    net = lm.Network()
    x = net.input("x", 4)
    net.outputs(y=Linear(4, 2)(x))
    feed = np.ones((3, 4), np.float32)
    ref = weakref.ref(feed)
    net.run({"x": feed})
    del feed
    assert ref() is None


@pytest.mark.parametrize("device", ["cpu"] + (["opencl"] if OPENCL_DEVICES else []))
def test_run_outputs_are_the_callers_own(device):
    """net.run hands over its output buffers on the CPU (no copy), so the next run, of the same
    batch shape or another, must write elsewhere: earlier results keep their values."""
    net = lm.Network()
    x = net.input("x", 4)
    net.outputs(y=Linear(4, 3)(x))
    if device == "opencl":
        from lamina.backends.opencl import OpenCLBackend, devices
        net.to(OpenCLBackend(devices().index(OPENCL_DEVICES[0])))
    w, b = (np.array(p.value) for p in net.parameters())
    rng = stable_rng("own outputs")
    feeds = [rng.standard_normal((rows, 4)).astype(np.float32) for rows in (5, 5, 2, 7)]
    results = [net.run({"x": f})["y"] for f in feeds]
    for f, y in zip(feeds, results):
        np.testing.assert_allclose(y, f @ w.T + b, rtol=1e-5, atol=1e-6)
    assert not any(np.shares_memory(a, c) for i, a in enumerate(results) for c in results[i + 1:])


# The resident size after an outlier counts the BLAS's own work buffers too. MKL's are small;
# OpenBLAS keeps one buffer of about 80 MB per calling thread and touches it as far as the largest
# GEMM so far reached, whichever thread ran it: bounded by the threads, not by the request. The
# memory tests run on MKL where lamina has it (every x86-64 build); elsewhere they allow
# OpenBLAS's buffers.
MEMORY_BLAS = "mkl" if "mkl" in BLAS_PROVIDERS else "openblas"
BLAS_ALLOWANCE = 0 if MEMORY_BLAS == "mkl" else 80 << 20  # bytes per thread


def test_an_outlier_runs_buffers_are_given_back_after_it():
    """Inference keeps its buffers from run to run, grown to the largest batch: one run far
    larger than the usual ones (20,000 steps against 50) must not set the process's size for
    good. Its binding is dropped after it and the heap trimmed; the usual runs that follow
    answer as before."""
    path = os.path.join(os.path.dirname(__file__), "..", "models", "python_lm", "model.lamina")
    net = lm.load(path).to(lm.CPUBackend(blas=MEMORY_BLAS))
    rng = np.random.default_rng(0)
    zeros = np.zeros((1, 1, 256), np.float32)

    def run(steps):
        ids = rng.integers(0, 4096, steps).astype(np.int32)
        feeds = {"ids": lm.Sequences(ids, np.array([0, steps], np.int32)), "h0": zeros, "c0": zeros}
        return net.run(feeds, ["last"])["last"]
    # an outlier through another copy of the network first warms what is not a network's to give
    # back: the BLAS's own work buffers (OpenBLAS keeps a fixed one, touched as far as the
    # largest GEMM so far reached)
    other = lm.load(path).to(lm.CPUBackend(blas=MEMORY_BLAS))
    ids = rng.integers(0, 4096, 20_000).astype(np.int32)
    other.run({"ids": lm.Sequences(ids, np.array([0, 20_000], np.int32)), "h0": zeros, "c0": zeros}, ["last"])
    for _ in range(5):
        run(50)
    before = rss_bytes()
    usual = net.scheduler.inference_bytes(["last"], 1, 50)
    assert net.scheduler.inference_bytes(["last"], 1, 20_000) > 100 << 20 > 100 * usual
    run(20_000)
    answers = [run(50) for _ in range(3)]
    assert rss_bytes() - before < (40 << 20) + BLAS_ALLOWANCE * lm.get_num_threads()
    assert all(np.isfinite(a).all() and a.shape == (1, 1, 256) for a in answers)
