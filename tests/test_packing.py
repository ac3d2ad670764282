"""A packed weight is a cache of the parameter's values: it must follow every change."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.cpu import CPUBackend
from lamina.layers import Linear, SquareError
from lamina.packing import PackedWeight


def packed_product(be, pw, x):
    out = np.empty((x.shape[0], pw.param.shape[0]), x.dtype)
    be.packed_gemm(x, pw.get(x.shape[0]), out)
    return out


@pytest.fixture
def setup():
    be = CPUBackend()
    net = lm.Network()
    fc = Linear(6, 4)
    net.outputs(c=SquareError()(fc(net.input("x", 6)), net.input("t", 4)))
    pw = PackedWeight(be, fc.weight, trans=True)  # x @ Wᵀ, as the layer computes it
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


def test_assign_and_load_repack(setup, tmp_path):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x)
    fc.weight.assign(np.full(fc.weight.shape, 0.25))
    np.testing.assert_allclose(packed_product(be, pw, x), expect(fc, x), rtol=1e-5)
    lm.save(net, tmp_path / "m.lamina")
    loaded = lm.load(tmp_path / "m.lamina")
    w = loaded.layer(fc.name).weight
    fresh = PackedWeight(be, w, trans=True)
    np.testing.assert_allclose(packed_product(be, fresh, x), x @ w.value.T, rtol=1e-5)


def test_thread_count_change_repacks(setup):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x)
    threads = lm.get_num_threads()
    lm.set_num_threads(1 if threads != 1 else 2)
    try:
        packed_product(be, pw, x)
        assert pw.repacks == 2
    finally:
        lm.set_num_threads(threads)


def test_more_rows_than_packed_for_repacks(setup):
    be, net, fc, pw, x = setup
    packed_product(be, pw, x[:2])
    big = np.tile(x, (20, 1))
    np.testing.assert_allclose(packed_product(be, pw, big), expect(fc, big), rtol=1e-5)
