"""One network, many threads: concurrent `run` calls on one loaded network give the answers of
sequential calls, at several batch shapes, on the CPU and on OpenCL; training and moves wait for
the runs in flight instead of changing the network under them."""
import threading
import time

import numpy as np
import pytest

import lamina as lm
from lamina.layers import LSTM, Embedding, Linear, SoftmaxCrossEntropy

from conftest import BLAS_PROVIDERS, OPENCL_DEVICES, stable_rng

DEVICES = ["cpu"] + (["opencl"] if OPENCL_DEVICES else [])
THREADS, CALLS = 4, 12


def language_model(tmp_path):
    """Embedding -> LSTM -> Linear with a cost, saved and loaded (the server's situation)."""
    lm.manual_seed(5)
    net = lm.Network()
    ids, y = net.input("ids", dtype="int32", sequence=True), net.input("y", dtype="int32", sequence=True)
    h = LSTM(8, 16)(Embedding(30, 8)(ids))[0]
    logits = Linear(16, 30)(h)
    net.outputs(loss=SoftmaxCrossEntropy()(logits, y), logits=logits)
    lm.save(net, tmp_path / "lm.lamina")
    return lm.load(tmp_path / "lm.lamina")


def batches(count):
    """Batches of different shapes (sequence counts and lengths), each with its labels."""
    out = []
    for i in range(count):
        rng = stable_rng("threads", i)
        lengths = rng.integers(1, 12, size=int(rng.integers(1, 9)))
        seqs = lm.Sequences.from_list([rng.integers(0, 30, n).astype(np.int32) for n in lengths])
        labels = lm.Sequences(rng.integers(0, 30, len(seqs.values)).astype(np.int32), seqs.starts)
        out.append({"ids": seqs, "y": labels})
    return out


def run_concurrently(work, threads=THREADS):
    errors, barrier = [], threading.Barrier(threads)

    def body(t):
        try:
            barrier.wait()
            work(t)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    pool = [threading.Thread(target=body, args=(t,)) for t in range(threads)]
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    if errors:
        raise errors[0]


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_runs_match_sequential_runs(device, tmp_path):
    net = language_model(tmp_path).to(device)
    feeds = batches(6)
    expected = [net.run({"ids": f["ids"]})["logits"].values for f in feeds]
    got = {}

    def work(t):
        for c in range(CALLS):
            i = (t + c) % len(feeds)
            got[(t, c)] = (i, net.run({"ids": feeds[i]["ids"]})["logits"].values)
    run_concurrently(work)
    assert len(got) == THREADS * CALLS
    for (t, c), (i, value) in got.items():
        np.testing.assert_allclose(value, expected[i], rtol=1e-5, atol=1e-6, err_msg=f"thread {t} call {c}")


@pytest.mark.parametrize("device", DEVICES)
def test_training_waits_for_runs_and_runs_see_whole_updates(device, tmp_path):
    """Inference threads run while the main thread trains: every run sees the weights either
    before or after a whole step, never a mix, and training is never corrupted by the runs."""
    net = language_model(tmp_path).to(device)
    twin = language_model(tmp_path).to(device)  # trained alone, for comparison
    feeds = batches(3)
    probe = feeds[0]["ids"]
    opt, twin_opt = lm.optim.SGD(net, lr=0.5), lm.optim.SGD(twin, lr=0.5)
    states = [twin.run({"ids": probe})["logits"].values]
    for step in range(3):
        twin.train_step(feeds[step], twin_opt)
        states.append(twin.run({"ids": probe})["logits"].values)
    seen, stop = [], threading.Event()

    def reader(t):
        while not stop.is_set():
            seen.append(net.run({"ids": probe})["logits"].values)

    readers = threading.Thread(target=run_concurrently, args=(reader, 2))
    readers.start()
    deadline = time.monotonic() + 30
    try:
        for step in range(3):
            wanted = len(seen) + 2  # let the readers in before each step, so the runs interleave
            while len(seen) < wanted and time.monotonic() < deadline:
                time.sleep(0.001)
            net.train_step(feeds[step], opt)
    finally:
        stop.set()
        readers.join()
    np.testing.assert_allclose(net.run({"ids": probe})["logits"].values, states[-1], rtol=1e-5, atol=1e-6)
    assert seen
    for value in seen:
        assert any(np.allclose(value, s, rtol=1e-5, atol=1e-6) for s in states), "a run saw a half-updated network"


def test_a_move_waits_for_runs_in_flight(tmp_path):
    net = language_model(tmp_path)
    feeds = batches(2)
    expected = net.run({"ids": feeds[0]["ids"]})["logits"].values
    results, stop = [], threading.Event()

    def reader(t):
        while not stop.is_set():
            results.append(net.run({"ids": feeds[0]["ids"]})["logits"].values)

    readers = threading.Thread(target=run_concurrently, args=(reader, 2))
    readers.start()
    deadline = time.monotonic() + 30
    try:
        moves = 0
        while (moves < 6 or len(results) < 20) and time.monotonic() < deadline:
            net.to(lm.CPUBackend(blas=BLAS_PROVIDERS[moves % len(BLAS_PROVIDERS)]))
            moves += 1
    finally:
        stop.set()
        readers.join()
    assert results
    for value in results:
        np.testing.assert_allclose(value, expected, rtol=1e-5, atol=1e-6)


def test_changing_the_network_inside_a_run_is_an_error(tmp_path):
    """A layer that trains its own network during a run would deadlock; it gets an error."""
    net = language_model(tmp_path)
    with net._lock.read():
        with pytest.raises(RuntimeError, match="finish the run first"):
            net.to("cpu")


@pytest.mark.parametrize("device", DEVICES)
def test_concurrent_runs_of_the_shipped_denoiser(device):
    """Convolutions, transposed convolutions and the CPU's split of samples over threads, from
    several threads at once, at several batch sizes."""
    from pathlib import Path
    from lamina.zoo import denoise
    net = lm.load(Path(__file__).resolve().parent.parent / "models/denoise3d/model.lamina").to(device)
    clean = denoise.shapes(6, np.random.default_rng(4))
    noisy = denoise.noisy_copy(clean, np.random.default_rng(5))
    # PoCL runs these convolutions slowly: fewer and smaller batches there
    batches = [noisy[:1], noisy[1:4], noisy[:6], noisy[4:6]] if device == "cpu" else [noisy[:1], noisy[1:3]]
    expected = [net.run({"noisy": b}, ["denoised"])["denoised"] for b in batches]
    got = {}

    def work(t):
        for c in range(len(batches)):
            i = (t + c) % len(batches)
            got[(t, c)] = (i, net.run({"noisy": batches[i]}, ["denoised"])["denoised"])
    run_concurrently(work)
    for (t, c), (i, value) in got.items():
        np.testing.assert_allclose(value, expected[i], rtol=1e-5, atol=1e-5, err_msg=f"thread {t} call {c}")
