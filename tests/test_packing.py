"""A packed weight is a cache of the parameter's values for one backend: it must follow every
change of values, provider, backend and thread count. Each test runs the packed recurrent path
of one network after the change and compares it with the plain (unpacked) path or the numpy
reference, so a stale pack fails it; every test runs for both GEMM providers (MKL's packed
format and lamina's panels)."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.cpu import CPUBackend
from lamina.backends.cpu.backend import MKL_PACK_ROWS
from lamina.layers import Linear, SquareError
from lamina.packing import PackedWeight

from conftest import BLAS_PROVIDERS, needs_mkl
from test_recurrent import batch, network, reference

PROVIDERS = BLAS_PROVIDERS


def packed_product(be, pw, x):
    out = np.empty((x.shape[0], pw.param.shape[0]), x.dtype)
    be.packed_gemm(x, pw.get(be, x.shape[0]), out)
    return out


@pytest.fixture(params=PROVIDERS)
def setup(request):
    be = CPUBackend(blas=request.param)
    net = lm.Network(backend=be)
    fc = Linear(6, 4)
    net.outputs(c=SquareError()(fc(net.input("x", 6)), net.input("t", 4)))
    pw = PackedWeight(fc.weight, trans=True)  # x @ Wᵀ, as the layer computes it
    x = np.random.default_rng(0).standard_normal((5, 6)).astype(np.float32)
    return be, net, fc, pw, x


def expect(fc, x):
    return x @ fc.weight.value.T


def test_pack_is_reused_while_values_stay(setup):
    be, net, fc, pw, x = setup
    np.testing.assert_allclose(packed_product(be, pw, x), expect(fc, x), rtol=1e-5)
    packed_product(be, pw, x)
    assert pw.repacks == 1


def test_optimizer_step_repacks(setup):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x)
    feeds = {"x": x, "t": np.ones((5, 4), np.float32)}
    net.train_step(feeds, lm.optim.SGD(net, lr=0.5))
    np.testing.assert_allclose(packed_product(be, pw, x), expect(fc, x), rtol=1e-5)
    assert pw.repacks == 2


def test_assign_repacks(setup):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x)
    fc.weight.assign(np.full(fc.weight.shape, 0.25))
    np.testing.assert_allclose(packed_product(be, pw, x), np.full((5, 4), 0.25 * x.sum(1, keepdims=True)),
                               rtol=1e-5)


def test_thread_count_change_repacks_and_computes_the_same(setup):
    be, net, fc, pw, x = setup
    first = packed_product(be, pw, x)
    threads = lm.get_num_threads()
    lm.set_num_threads(1 if threads != 1 else 2)
    try:
        np.testing.assert_allclose(packed_product(be, pw, x), first, rtol=1e-6)
        assert pw.repacks == 2
    finally:
        lm.set_num_threads(threads)


def test_more_rows_than_packed_for_repacks(setup):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x[:2])
    big = np.tile(x, (20, 1))
    np.testing.assert_allclose(packed_product(be, pw, big), expect(fc, big), rtol=1e-5)


@needs_mkl
def test_a_pack_from_another_provider_is_refused():
    w = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float32)
    mkl, openblas = CPUBackend(blas="mkl"), CPUBackend(blas="openblas")
    with pytest.raises(ValueError, match="packed_gemm: .*computes with 'panels' packs, found 'mkl'"):
        openblas.packed_gemm(np.ones((2, 4), np.float32), mkl.pack(w), np.empty((2, 6), np.float32))


# -- the recurrent layers, the packs' real users

def recurrent(kind, blas):
    lm.manual_seed(3)
    net, layer, outs = network(kind, dict(bidirectional=True), packed=True, in_size=4, hidden=8)
    cost = SquareError()(outs[1], net.input("t", (2, 8)))
    net.outputs(out=outs[0], cost=cost)
    net.to(CPUBackend(blas=blas))
    return net, layer


SEQS = batch([3, 5, 2], 4, seed=10, dtype=np.float32)
TARGET = {"t": np.ones((3, 2, 8), np.float32)}


@pytest.mark.parametrize("blas", PROVIDERS)
@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_recurrent_pack_follows_assign_and_checkpoint_restore(kind, blas, tmp_path):
    net, layer = recurrent(kind, blas)
    before = net.run({"x": SEQS})["out"].values
    opt = lm.optim.SGD(net, lr=0.5)
    lm.save_checkpoint(tmp_path / "c.lamina", net, opt)
    w = layer.params["weight_hh_l0"]
    w.assign(w.value * -1.5)  # in place, same buffer: only the version tells the pack
    np.testing.assert_allclose(net.run({"x": SEQS})["out"].values, reference(kind, layer, SEQS)[0],
                               rtol=1e-4, atol=1e-5)
    # restoring a checkpoint into this network (not a fresh one) writes the old values back
    lm.load_checkpoint(tmp_path / "c.lamina").load_into(net)
    np.testing.assert_allclose(net.run({"x": SEQS})["out"].values, before, rtol=1e-5, atol=1e-6)


@needs_mkl
@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_recurrent_network_moves_between_providers(kind):
    """MKL packs and lamina's panels are different formats: each move repacks."""
    net, layer = recurrent(kind, "mkl")
    expected = reference(kind, layer, SEQS)[0]
    for blas in ("mkl", "openblas", "mkl", "openblas"):
        net.to(CPUBackend(blas=blas))
        np.testing.assert_allclose(net.run({"x": SEQS})["out"].values, expected, rtol=1e-4, atol=1e-5)
        net.train_step({"x": SEQS, **TARGET}, lm.optim.SGD(net, lr=0.1))
        expected = reference(kind, layer, SEQS)[0]
        np.testing.assert_allclose(net.run({"x": SEQS})["out"].values, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("blas", PROVIDERS)
def test_linear_inference_follows_training_and_assign(blas):
    """At inference a Linear computes from its weight's pack where the backend says so (few rows:
    lamina's panels, or MKL's pack made for MKL_PACK_ROWS): after a training step and after an
    assign, run gives the new weights' result, and the pack is built once per change of values,
    not per run, nor for other batch sizes up to the rows it was made for."""
    be = CPUBackend(blas=blas)
    net = lm.Network(backend=be)
    fc = Linear(6, 4)
    y = fc(net.input("x", 6))
    net.outputs(y=y, c=SquareError()(y, net.input("t", 4)))
    rng = np.random.default_rng(0)
    x, t = (rng.standard_normal((5, n)).astype(np.float32) for n in (6, 4))
    assert be.packs_fixed_weights(5, 6, 4) == (5 if blas == "openblas" else MKL_PACK_ROWS)
    assert be.packs_fixed_weights(MKL_PACK_ROWS + 1, 6, 4) == (MKL_PACK_ROWS + 1 if blas == "openblas" else 0)

    def check(packs):
        for rows in (5, 3, 5) if blas == "mkl" else (5, 5, 5):
            np.testing.assert_allclose(net.run({"x": x[:rows]}, ["y"])["y"],
                                       x[:rows] @ fc.weight.value.T + fc.bias.value, rtol=1e-5, atol=1e-6)
        assert sum(p.repacks for p in fc._packs.values()) == packs
    check(1)
    net.train_step({"x": x, "t": t}, lm.optim.SGD(net, lr=0.5))
    check(2)
    fc.weight.assign(fc.weight.value * -2)
    check(3)
