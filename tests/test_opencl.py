"""The OpenCL backend on every OpenCL device here (PYOPENCL_TEST picks one, as pyopencl's own
tests do; `make test` installs PoCL so every machine has a CPU device): kernel conformance
against the numpy reference at sizes that are not tile multiples, layers against the CPU
backend (outputs and every gradient), training from one start on both, moving a network and its
optimizer state, a steady memory pool, and a clear error for layers without kernels."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.reference import ReferenceBackend
from lamina.errors import GraphError
from lamina.parameter import host
from lamina.layers import (BCEWithLogits, Activation, Add, Concat, Dropout, Linear, Scale,
                           SoftmaxCrossEntropy, SquareError)

from conftest import NO_OPENCL, OPENCL_DEVICES as FOUND
from lamina.backends.opencl import TILE_CHOICES

if FOUND:
    from lamina.backends.opencl import OpenCLBackend

pytestmark = pytest.mark.skipif(not FOUND, reason=NO_OPENCL)
REF = ReferenceBackend()
SIZES = [1, 7, 33, 129]


@pytest.fixture(scope="module", params=range(len(FOUND)) if FOUND else [None],
                ids=[d.name.strip() for d in FOUND] if FOUND else ["none"])
def cl(request):
    return OpenCLBackend(request.param)


def dtypes(cl):
    return [np.float32] + ([np.float64] if cl.fp64 else [])


def close(got, want, dtype):
    tol = dict(rtol=2e-5, atol=2e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(got, want, **tol)


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("index", [slice(3, 9), slice(None, 4), slice(-5, None), slice(7, 3), slice(0, 100),
                                   slice(18, 30), slice(2, 11, 3), 4, (slice(1, 5), 2)])
def test_array_views_equal_numpys(cl, index):
    """The backend's arrays build row slices themselves (a fast path); every view, fast or not,
    holds what numpy's view of the same data holds, and a view of a view too."""
    host = np.random.default_rng(0).standard_normal((20, 6, 5)).astype(np.float32)
    a = cl.from_host(host)
    views = [(a[index], host[index])]
    if type(index) is slice and views[0][1].shape[0] > 2:
        views.append((views[0][0][1:3], views[0][1][1:3]))
    for view, want in views:
        assert (view.shape, view.strides) == (want.shape, want.strides)
        assert view.offset == want.__array_interface__["data"][0] - host.__array_interface__["data"][0]
        if view.flags.forc:  # (pyopencl reads back only contiguous arrays)
            np.testing.assert_array_equal(view.get(), want)


@pytest.mark.parametrize("rows,shape", [(None, (120, 5)), (None, (20, -1)), (None, (-1,)), (None, (600,)),
                                        (None, (2, 10, 30)), (None, [4, 150]), (slice(4, 10), (-1, 5)),
                                        (slice(4, 10), (180,)), (slice(4, 10), (6, 2, 15))])
def test_array_reshapes_equal_numpys(cl, rows, shape):
    """A reshape of a contiguous array (or of a row slice of one) is a view built directly; it
    holds what numpy's reshape holds, a shape passed as one tuple or list too."""
    host = np.random.default_rng(1).standard_normal((20, 6, 5)).astype(np.float32)
    a = cl.from_host(host)
    source, ref = (a, host) if rows is None else (a[rows], host[rows])
    for view in (source.reshape(*shape), source.reshape(shape)):
        want = ref.reshape(*shape)
        assert view.shape == want.shape
        np.testing.assert_array_equal(view.get(), want)


@pytest.mark.parametrize("shape", [(7, -1), (-1, -1), (601,)])
def test_array_reshape_to_another_size_is_refused(cl, shape):
    a = cl.from_host(np.zeros((20, 30), np.float32))
    with pytest.raises(ValueError):
        a.reshape(*shape)


def test_gemm(cl):
    rng = np.random.default_rng(0)
    for dtype in dtypes(cl):
        for m in SIZES:
            for n, k in ((7, 129), (33, 1), (129, 33), (64, 40)):
                for ta in (False, True):
                    for tb in (False, True):
                        for beta in (0.0, 1.0):
                            a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                            b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                            start = rng.standard_normal((m, n)).astype(dtype) if beta else np.full((m, n), np.nan, dtype)
                            c = cl.from_host(start)
                            want = start.astype(np.float64).copy()
                            cl.gemm(cl.from_host(a), cl.from_host(b), c, ta, tb, 0.75, beta)
                            REF.gemm(a.astype(np.float64), b.astype(np.float64), want, ta, tb, 0.75, beta)
                            np.testing.assert_allclose(c.get(), want, rtol=1e-4 if dtype == np.float32 else 1e-10,
                                                       atol=1e-4 if dtype == np.float32 else 1e-10,
                                                       err_msg=f"{m}x{n}x{k} ta={ta} tb={tb} beta={beta}")


@pytest.mark.parametrize("tiles", TILE_CHOICES, ids=lambda t: "x".join(map(str, t)))
def test_gpu_gemm_kernel(cl, tiles):
    """The tiled local-memory kernel GPUs get, with each tile choice a device may get, run here
    too (PoCL executes it correctly, if slowly), so its edges and transposes are checked on every
    machine."""
    rng = np.random.default_rng(4)
    was = cl.cpu_device, cl.tiles
    cl.cpu_device, cl.tiles = False, tiles
    try:
        for dtype in dtypes(cl):
            for m, n, k in ((1, 1, 1), (7, 33, 129), (129, 7, 33), (65, 130, 17), (257, 131, 40)):
                for ta in (False, True):
                    for tb in (False, True):
                        a = rng.standard_normal((k, m) if ta else (m, k)).astype(dtype)
                        b = rng.standard_normal((n, k) if tb else (k, n)).astype(dtype)
                        start = rng.standard_normal((m, n)).astype(dtype)
                        c = cl.from_host(start)
                        cl.gemm(cl.from_host(a), cl.from_host(b), c, ta, tb, 0.5, 1.0)
                        want = 0.5 * (a.T if ta else a).astype(np.float64) @ (b.T if tb else b) + start
                        close(c.get(), want, dtype)
    finally:
        cl.cpu_device, cl.tiles = was


def test_gemm_tiles_follow_the_device(monkeypatch):
    """The largest tiles whose work-group and local memory the device takes; LAMINA_OPENCL_TILES
    sets them, and a malformed setting is refused by name."""
    from types import SimpleNamespace
    from lamina.backends.opencl import gemm_tiles
    big = SimpleNamespace(max_work_group_size=1024, max_work_item_sizes=[1024, 1024, 64], local_mem_size=49152)
    small = SimpleNamespace(max_work_group_size=128, max_work_item_sizes=[128, 128, 64], local_mem_size=49152)
    tiny = SimpleNamespace(max_work_group_size=16, max_work_item_sizes=[16, 16, 16], local_mem_size=4096)
    assert [gemm_tiles(d) for d in (big, small, tiny)] == [TILE_CHOICES[0], TILE_CHOICES[1], TILE_CHOICES[2]]
    monkeypatch.setenv("LAMINA_OPENCL_TILES", "64,32,8,4,4")
    assert gemm_tiles(big) == (64, 32, 8, 4, 4)
    for bad in ("64,32,8,4", "64,30,8,4,4", "a,b,c,d,e", "0,32,8,4,4", "64,64,6,8,8"):
        monkeypatch.setenv("LAMINA_OPENCL_TILES", bad)
        with pytest.raises(lm.OpenCLError, match="LAMINA_OPENCL_TILES: expected"):
            gemm_tiles(big)


def test_elementwise_and_row_kernels(cl):
    rng = np.random.default_rng(1)
    for dtype in dtypes(cl):
        for rows in SIZES:
            cols = 33
            x = rng.standard_normal((rows, cols)).astype(dtype)
            dy = rng.standard_normal((rows, cols)).astype(dtype)
            b = rng.standard_normal(cols).astype(dtype)
            for kind in lm.backends.base.ALL_ACTIVATIONS:
                y, y_ref = cl.empty(x.shape, dtype), np.empty_like(x)
                cl.activation(kind, cl.from_host(x), y, 0.1)
                REF.activation(kind, x, y_ref, 0.1)
                close(y.get(), y_ref, dtype)
                for beta in (0.0, 1.0):
                    start = x.copy() if beta else np.full_like(x, np.nan)
                    dx, dx_ref = cl.from_host(start), start.copy()
                    cl.activation_backward(kind, cl.from_host(y_ref), cl.from_host(dy), dx, beta, 0.1)
                    REF.activation_backward(kind, y_ref, dy, dx_ref, beta, 0.1)
                    close(dx.get(), dx_ref, dtype)
            got, want = cl.from_host(x), x.copy()
            cl.add_bias(got, cl.from_host(b))
            REF.add_bias(want, b)
            close(got.get(), want, dtype)
            db, db_ref = cl.from_host(b), b.copy()
            cl.bias_grad(cl.from_host(dy), db, 1.0)
            REF.bias_grad(dy, db_ref, 1.0)
            close(db.get(), db_ref, dtype)
            out, out_ref = cl.from_host(dy), dy.copy()
            cl.axpby(0.5, cl.from_host(x), 2.0, out)
            REF.axpby(0.5, x, 2.0, out_ref)
            close(out.get(), out_ref, dtype)
            cl.multiply(cl.from_host(x), cl.from_host(dy), out, 1.0)
            REF.multiply(x, dy, out_ref, 1.0)
            close(out.get(), out_ref, dtype)
            np.testing.assert_allclose(cl.sum_squares(cl.from_host(x)), REF.sum_squares(x), rtol=1e-5)
            # rows and columns
            index = rng.permutation(rows).astype(np.int32)
            wide = rng.standard_normal((rows, cols + 5)).astype(dtype)
            g, g_ref = cl.empty(x.shape, dtype), np.empty_like(x)
            cl.gather_rows(cl.from_host(wide), index, g, col=2)
            REF.gather_rows(wide, index, g_ref, col=2)
            close(g.get(), g_ref, dtype)
            w2, w2_ref = cl.from_host(wide), wide.copy()
            cl.scatter_rows(cl.from_host(x), index, w2, 1.0, col=3)
            REF.scatter_rows(x, index, w2_ref, 1.0, col=3)
            close(w2.get(), w2_ref, dtype)
            ids = rng.integers(0, 3, rows).astype(np.int32)
            base = rng.standard_normal((3, cols)).astype(dtype)
            acc, acc_ref = cl.from_host(base), base.copy()
            cl.scatter_add_rows(cl.from_host(x), ids, acc)
            REF.scatter_add_rows(x, ids, acc_ref)
            close(acc.get(), acc_ref, dtype)
            cc, cc_ref = cl.from_host(wide), wide.copy()
            cl.copy_to_columns(cl.from_host(x), cc, 4, 1.0)
            REF.copy_to_columns(x, cc_ref, 4, 1.0)
            close(cc.get(), cc_ref, dtype)
            back, back_ref = cl.empty(x.shape, dtype), np.empty_like(x)
            cl.copy_from_columns(cl.from_host(wide), 5, back)
            REF.copy_from_columns(wide, 5, back_ref)
            close(back.get(), back_ref, dtype)


def test_cost_and_optimizer_kernels(cl):
    rng = np.random.default_rng(2)
    for dtype in dtypes(cl):
        for rows in SIZES:
            x = (2 * rng.standard_normal((rows, 7))).astype(dtype)
            t = rng.random((rows, 7)).astype(dtype)
            labels = rng.integers(0, 7, rows).astype(np.int32)
            w = rng.random(rows).astype(dtype)
            dcost = rng.standard_normal(rows).astype(dtype)
            for weights in (None, w):
                dw = None if weights is None else cl.from_host(weights)
                probs, cost = cl.empty(x.shape, dtype), cl.empty((rows,), dtype)
                probs_ref, cost_ref = np.empty_like(x), np.empty(rows, dtype)
                cl.softmax_cross_entropy(cl.from_host(x), cl.from_host(labels), dw, probs, cost)
                REF.softmax_cross_entropy(x, labels, weights, probs_ref, cost_ref)
                close(cost.get(), cost_ref, dtype)
                dx, dx_ref = cl.from_host(x), x.copy()
                cl.softmax_cross_entropy_backward(probs, cl.from_host(labels), dw, cl.from_host(dcost), dx, 1.0)
                REF.softmax_cross_entropy_backward(probs_ref, labels, weights, dcost, dx_ref, 1.0)
                close(dx.get(), dx_ref, dtype)
                for name in ("square_error", "bce_with_logits"):
                    cost, cost_ref = cl.empty((rows,), dtype), np.empty(rows, dtype)
                    getattr(cl, name)(cl.from_host(x), cl.from_host(t), dw, cost)
                    getattr(REF, name)(x, t, weights, cost_ref)
                    close(cost.get(), cost_ref, dtype)
                    for wrt in (False, True):
                        d, d_ref = cl.empty(x.shape, dtype), np.empty_like(x)
                        getattr(cl, name + "_backward")(cl.from_host(x), cl.from_host(t), dw, cl.from_host(dcost), d, wrt)
                        getattr(REF, name + "_backward")(x, t, weights, dcost, d_ref, wrt)
                        close(d.get(), d_ref, dtype)
        n = 129
        p, g, s, m, v = rng.standard_normal((5, n)).astype(dtype)
        s, v = np.abs(s), np.abs(v)
        runs = []
        for be, put in ((cl, cl.from_host), (REF, np.copy)):
            arrays = [put(a) for a in (p, s, m, v)]
            pp, ss, mm, vv = arrays
            gg = put(g)
            be.sgd_update(pp, gg, mm, 0.1, 0.9, 0.1, False, 0.01)
            be.sgd_update(pp, gg, mm, 0.1, 0.9, 0.0, True, 0.0)
            be.adam_update(pp, gg, mm, vv, 0.01, 0.9, 0.999, 1e-8, 0.01, False, 3)
            be.adam_update(pp, gg, mm, vv, 0.01, 0.9, 0.999, 1e-8, 0.01, True, 4)
            be.adagrad_update(pp, gg, ss, 0.1, 1e-10, 0.01)
            be.rmsprop_update(pp, gg, ss, mm, 0.01, 0.99, 1e-8, 0.01, 0.9)
            runs.append([a if isinstance(a, np.ndarray) else a.get() for a in arrays])
        for got, want in zip(*runs):
            close(got, want, dtype)


def test_dropout_mask(cl):
    mask = cl.empty((100000,), np.float32)
    cl.bernoulli_mask(mask, 0.8, np.random.default_rng(0))
    m = mask.get()
    assert set(np.unique(m)) == {0.0, np.float32(1 / 0.8)}
    assert abs((m > 0).mean() - 0.8) < 0.01


# ---------------------------------------------------------------- layers and networks

def dense_net(seed=0):
    lm.manual_seed(seed)
    net = lm.Network()
    x = net.input("x", 6)
    z = net.input("z", 4)
    y = net.input("y", dtype="int32")
    t = net.input("t", 5)
    h = Linear(6, 8, activation="tanh", name="a")(x)
    g = Linear([8, 4], 8, activation="leaky_relu", name="b")(h, z)
    s = Add(activation="sigmoid", name="add")(g, Scale(0.5, name="half")(h))
    c = Concat(name="cat")(s, lm.layers.PReLU(8, name="prelu")(h))
    square = lm.layers.Transpose((1, 0), name="turned")(lm.layers.Reshape((4, 4), name="square")(c))
    m = lm.layers.Multiply(name="mul")(c, lm.layers.Reshape((16,), name="flat")(square))
    gate = Add(name="gate")(lm.layers.Broadcast((4, 4), name="rows_gate")(lm.layers.Reshape((4, 1), name="col")(z)),
                            lm.layers.Broadcast((4, 4), name="cols_gate")(lm.layers.Reshape((1, 4), name="row")(z)))
    m = Add(name="gated")(m, lm.layers.Reshape((16,), name="gate_flat")(
        lm.layers.Multiply(name="gating")(square, gate)))
    wide = lm.layers.Resize((7,), mode="nearest", coordinates="asymmetric", rounding="floor", name="widen")(square)
    back = lm.layers.Resize((4,), mode="linear", coordinates="align_corners", name="narrow")(wide)
    m = Add(name="resized")(m, lm.layers.Reshape((16,), name="resized_flat")(back))
    logits = Linear(16, 3, name="logits")(lm.layers.Bias((16,), name="shift")(m))
    reg = Linear(16, 5, activation="exponential", name="reg")(Dropout(0.0, name="drop")(c))
    net.outputs(xent=SoftmaxCrossEntropy(name="xent")(logits, y), se=SquareError(name="se")(reg, t),
                bce=BCEWithLogits(name="bce")(Linear([16, 8], 5, name="bl")(
                    c, lm.layers.Reshape((8,), name="rows")(lm.layers.Slice(1, 3, name="part")(square))), t),
                probs=Activation("softmax", name="sm")(logits))
    net.values["x"].requires_grad = True
    return net


def dense_feeds(rows=33, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((rows, 6)).astype(np.float32),
            "z": rng.standard_normal((rows, 4)).astype(np.float32),
            "y": rng.integers(0, 3, rows).astype(np.int32),
            "t": rng.random((rows, 5)).astype(np.float32)}


def test_layers_agree_with_the_cpu(cl):
    feeds = dense_feeds()
    cpu, dev = dense_net(), dense_net().to(cl)
    want = cpu.run(feeds)
    got = dev.run(feeds)
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)
    for net in (cpu, dev):
        net.forward(feeds)
        net.backward()
    np.testing.assert_allclose(host(dev.grad("x")), cpu.grad("x"), rtol=1e-4, atol=1e-6)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(host(q.grad), p.grad, rtol=1e-4, atol=1e-6, err_msg=name)


def test_training_from_one_start(cl):
    """20 Adam steps on the CPU and on the device from the same start: the same losses."""
    losses = {}
    for where in ("cpu", cl):
        net = dense_net().to(where) if where != "cpu" else dense_net()
        opt = lm.optim.Adam(net, lr=0.01, clip_norm=10.0)
        losses[str(where)] = [net.train_step(dense_feeds(seed=s), opt) for s in range(20)]
    cpu, dev = losses.values()
    np.testing.assert_allclose(dev, cpu, rtol=1e-3)
    assert cpu[-1] < cpu[0]


def test_moving_keeps_results_and_optimizer_state(cl, tmp_path):
    net = dense_net()
    opt = lm.optim.Adam(net, lr=0.01)
    for s in range(3):
        net.train_step(dense_feeds(seed=s), opt)
    reference = dense_net()
    ref_opt = lm.optim.Adam(reference, lr=0.01)
    for s in range(6):
        reference.train_step(dense_feeds(seed=s), ref_opt)
    net.to(cl)
    for s in range(3, 5):
        net.train_step(dense_feeds(seed=s), opt)
    net.to("cpu")
    net.train_step(dense_feeds(seed=5), opt)
    for (name, p), (_, q) in zip(reference.named_parameters(), net.named_parameters()):
        np.testing.assert_allclose(q.value, p.value, rtol=1e-4, atol=1e-6, err_msg=name)
    # a model saved on the device loads on the CPU and back
    net.to(cl)
    lm.save(net, tmp_path / "m.lamina")
    feeds = dense_feeds(seed=9)
    loaded = lm.load(tmp_path / "m.lamina")
    np.testing.assert_allclose(loaded.run(feeds)["probs"], net.run(feeds)["probs"], rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(loaded.to(cl).run(feeds)["probs"], net.run(feeds)["probs"])


@pytest.mark.slow
def test_memory_pool_stays_flat(cl):
    net = dense_net().to(cl)
    opt = lm.optim.Adam(net, lr=0.001)
    feeds = dense_feeds()
    held = []
    for step in range(1000):
        net.train_step(feeds, opt)
        if step in (10, 999):  # blocks the pool owns: free ones plus those in use
            held.append(cl.pool.held_blocks + cl.pool.active_blocks)
    assert held[1] <= held[0]


def test_layers_that_need_host_arrays_are_named(cl):
    class Custom(lm.layers.Scale):  # a user's layer that calls numpy on its arrays
        needs_host_arrays = True
    net = lm.Network()
    x = net.input("x", 3)
    net.outputs(y=Custom(2.0, name="mine")(x))
    with pytest.raises(GraphError, match=r"layer 'mine' \(Custom\) calls numpy on its arrays"):
        net.to(cl)


def test_a_users_layer_written_against_the_interface_runs_on_opencl(cl):
    class Custom(lm.layers.Scale):
        pass
    net = lm.Network()
    x = net.input("x", 3)
    net.outputs(y=Custom(2.0, name="mine")(x))
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3)}
    np.testing.assert_allclose(net.to(cl).run(feeds)["y"], 2 * feeds["x"])


def test_no_layer_kind_needs_host_arrays():
    assert [kind for kind, cls in lm.layers.REGISTRY.items() if cls.needs_host_arrays] == []


@pytest.mark.parametrize("frozen", [False, True], ids=["batch-statistics", "frozen-statistics"])
@pytest.mark.parametrize("kind,affine", [("BatchNorm3d", True), ("BatchNorm3d", False), ("BatchNorm2d", True)])
def test_batch_norm_agrees_with_the_cpu(cl, kind, affine, frozen):
    nd = 3 if kind.endswith("3d") else 2
    spatial = (3, 4, 5)[:nd] if nd == 3 else (6, 5)

    def build():
        lm.manual_seed(17)
        net = lm.Network()
        x = net.input("x", (4,) + spatial)
        bn = getattr(lm.layers, kind)(4, affine=affine, frozen_statistics=frozen, name="bn")
        net.outputs(y=bn(x))
        bn.params["running_mean"].assign(np.linspace(-1, 1, 4))
        bn.params["running_var"].assign(np.linspace(0.5, 2, 4))
        net.values["x"].requires_grad = True
        return net

    rng = np.random.default_rng(18)
    feeds = {"x": (2 + 3 * rng.standard_normal((3, 4) + spatial)).astype(np.float32)}
    g = {"y": rng.standard_normal((3, 4) + spatial).astype(np.float32)}
    cpu, dev = build(), build().to(cl)
    for net in (cpu, dev):
        for _ in range(2):
            net.forward(feeds, grad_outputs=["y"])
            net.backward(grad_outputs=g)
    np.testing.assert_allclose(host(dev.grad("x")), cpu.grad("x"), rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(q.value, p.value, rtol=1e-5, atol=1e-6, err_msg=name)  # running statistics
        if p.grad_pending:
            np.testing.assert_allclose(host(q.grad), p.grad, rtol=1e-4, atol=1e-4, err_msg=name)
    np.testing.assert_allclose(dev.run(feeds)["y"], cpu.run(feeds)["y"], rtol=1e-4, atol=1e-5)


def recurrent_net(kind, options, hidden, seed):
    """x (5 features a step) and initial states s0 (s1) -> a recurrent layer -> out, last; the
    inputs require gradients. Returns (net, directions x layers, state count)."""
    D, L = 2 if options.get("bidirectional") else 1, options.get("num_layers", 1)
    states = 2 if kind == "LSTM" else 1
    lm.manual_seed(seed)
    net = lm.Network()
    x = net.input("x", 5, sequence=True)
    inits = [net.input(f"s{i}", (L * D, hidden)) for i in range(states)]
    outs = getattr(lm.layers, kind)(5, hidden, name="rec", **options)(x, *inits)
    net.outputs(out=outs[0], last=outs[1])
    for name in ["x"] + [f"s{i}" for i in range(states)]:
        net.values[name].requires_grad = True
    return net, L * D, states


@pytest.mark.parametrize("kind,options", [
    ("RNN", dict(nonlinearity="tanh")), ("RNN", dict(nonlinearity="relu", bidirectional=True)),
    ("LSTM", dict()), ("LSTM", dict(bidirectional=True, num_layers=2)), ("LSTM", dict(reverse=True)),
    ("LSTM", dict(peepholes=True, clip=0.8, bidirectional=True)),
    ("GRU", dict()), ("GRU", dict(bidirectional=True, num_layers=2)),
    ("GRU", dict(linear_before_reset=False, bidirectional=True, num_layers=2)),
])
def test_recurrent_layers_agree_with_the_cpu(cl, kind, options):
    """Outputs, last states and every gradient (inputs, initial states, weights) of a
    recurrent layer on the device against the CPU, over ragged sequences with ties."""
    D = 2 if options.get("bidirectional") else 1
    cpu, LD, states = recurrent_net(kind, options, 7, 4)
    dev = recurrent_net(kind, options, 7, 4)[0].to(cl)
    rng = np.random.default_rng(7)
    seqs = lm.Sequences.from_list([rng.standard_normal((n, 5)).astype(np.float32) for n in (4, 1, 6, 4, 2)])
    feeds = {"x": seqs, **{f"s{i}": rng.standard_normal((5, LD, 7)).astype(np.float32) for i in range(states)}}
    grads = {"out": rng.standard_normal((seqs.total_steps, D * 7)).astype(np.float32),
             "last": rng.standard_normal((5, LD, 7)).astype(np.float32)}
    for net in (cpu, dev):
        net.forward(feeds, grad_outputs=["out", "last"])
        net.backward(grad_outputs=grads)
    want, got = cpu.run(feeds), dev.run(feeds)
    np.testing.assert_allclose(got["out"].values, want["out"].values, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(got["last"], want["last"], rtol=1e-4, atol=1e-5)
    for name in feeds:
        np.testing.assert_allclose(host(dev.grad(name)), cpu.grad(name), rtol=1e-4, atol=1e-5, err_msg=name)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(host(q.grad), p.grad, rtol=1e-4, atol=1e-5, err_msg=name)


def test_cell_kernels(cl):
    rng = np.random.default_rng(3)
    for dtype in dtypes(cl):
        for rows, H in ((1, 1), (7, 33), (33, 7)):
            for has_prev in (False, True):
                g = rng.standard_normal((rows, 4 * H)).astype(dtype)
                prev = rng.standard_normal((rows, H)).astype(dtype) if has_prev else None
                dev_prev = cl.from_host(prev) if has_prev else None
                gd, c, h = cl.from_host(g), cl.empty((rows, H), dtype), cl.empty((rows, H), dtype)
                g_ref, c_ref, h_ref = g.copy(), np.empty((rows, H), dtype), np.empty((rows, H), dtype)
                cl.lstm_step(gd, dev_prev, c, h)
                REF.lstm_step(g_ref, prev, c_ref, h_ref)
                for a, b in ((gd, g_ref), (c, c_ref), (h, h_ref)):
                    close(host(a), b, dtype)
                dh, dc = rng.standard_normal((2, rows, H)).astype(dtype)
                dg, dg_ref = cl.empty((rows, 4 * H), dtype), np.empty((rows, 4 * H), dtype)
                dcp, dcp_ref = (cl.from_host(dc), dc.copy()) if has_prev else (None, None)
                cl.lstm_step_backward(gd, dev_prev, c, cl.from_host(dh), cl.from_host(dc), dg, dcp)
                REF.lstm_step_backward(g_ref, prev, c_ref, dh, dc, dg_ref, dcp_ref)
                close(host(dg), dg_ref, dtype)
                if has_prev:
                    close(host(dcp), dcp_ref, dtype)
                g3 = rng.standard_normal((rows, 3 * H)).astype(dtype)
                hh = rng.standard_normal((rows, 3 * H)).astype(dtype)
                g3d, h, g3_ref, h_ref = cl.from_host(g3), cl.empty((rows, H), dtype), g3.copy(), np.empty((rows, H), dtype)
                cl.gru_step(g3d, cl.from_host(hh), dev_prev, h)
                REF.gru_step(g3_ref, hh, prev, h_ref)
                close(host(g3d), g3_ref, dtype)
                close(host(h), h_ref, dtype)
                dgx, dgh = cl.empty((rows, 3 * H), dtype), cl.empty((rows, 3 * H), dtype)
                dgx_ref, dgh_ref = np.empty((rows, 3 * H), dtype), np.empty((rows, 3 * H), dtype)
                dhp, dhp_ref = (cl.from_host(dc), dc.copy()) if has_prev else (None, None)
                cl.gru_step_backward(g3d, cl.from_host(hh), dev_prev, cl.from_host(dh), dgx, dgh, dhp)
                REF.gru_step_backward(g3_ref, hh, prev, dh, dgx_ref, dgh_ref, dhp_ref)
                close(host(dgx), dgx_ref, dtype)
                close(host(dgh), dgh_ref, dtype)
                if has_prev:
                    close(host(dhp), dhp_ref, dtype)


@pytest.mark.parametrize("mode", ["last", "first", "average", "sum", "max"])
def test_sequence_layers_agree_with_the_cpu(cl, mode):
    """Embedding -> LSTM -> SequencePool and SequenceSoftmax attention, outputs and gradients."""
    def build():
        lm.manual_seed(5)
        net = lm.Network()
        ids = net.input("ids", dtype="int32", sequence=True)
        y = net.input("y", dtype="int32")
        h = lm.layers.LSTM(4, 6, name="lstm")(lm.layers.Embedding(11, 4, name="emb")(ids))[0]
        score = lm.layers.SequenceSoftmax(name="attend")(Linear(6, 1, name="score")(h))
        pooled = lm.layers.SequencePool(mode, name="pool")(h)
        net.outputs(loss=SoftmaxCrossEntropy(name="xent")(Linear(6, 3, name="out")(pooled), y), attention=score)
        return net

    rng = np.random.default_rng(8)
    feeds = {"ids": lm.Sequences.from_list([rng.integers(0, 11, n).astype(np.int32) for n in (3, 1, 5, 3)]),
             "y": rng.integers(0, 3, 4).astype(np.int32)}
    cpu, dev = build(), build().to(cl)
    want, got = cpu.run(feeds), dev.run(feeds)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got["attention"].values, want["attention"].values, rtol=1e-4, atol=1e-6)
    for net in (cpu, dev):
        net.forward(feeds)
        net.backward()
    checked = 0
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        assert p.grad_pending == q.grad_pending, name
        if p.grad_pending:  # the attention branch feeds no cost: no gradient there
            np.testing.assert_allclose(host(q.dense_grad(dev.backend)), p.dense_grad(cpu.backend), rtol=1e-4,
                                       atol=1e-6, err_msg=name)
            checked += 1
    assert checked == 7


@pytest.mark.parametrize("make", [lambda n: lm.optim.SGD(n, lr=0.1), lambda n: lm.optim.AdaGrad(n, lr=0.1),
                                  lambda n: lm.optim.Adam(n, lr=0.01, lazy=True),
                                  lambda n: lm.optim.SGD(n, lr=0.1, momentum=0.9, lazy=True)])
def test_sparse_row_updates_agree_with_the_cpu(cl, make):
    def build():
        lm.manual_seed(6)
        net = lm.Network()
        ids = net.input("ids", dtype="int32")
        y = net.input("y", dtype="int32")
        net.outputs(loss=SoftmaxCrossEntropy()(Linear(4, 3, name="out")(lm.layers.Embedding(50, 4, name="emb")(ids)), y))
        return net

    rng = np.random.default_rng(9)
    batches = [{"ids": rng.integers(0, 50, 16).astype(np.int32), "y": rng.integers(0, 3, 16).astype(np.int32)}
               for _ in range(5)]
    nets = []
    for where in ("cpu", cl):
        net = build() if where == "cpu" else build().to(where)
        opt = make(net)
        for b in batches:
            net.train_step(b, opt)
        nets.append(net)
    np.testing.assert_allclose(nets[1].layer("emb").weight.value, nets[0].layer("emb").weight.value,
                               rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("activation,cost", [("linear", "ce"), ("exponential", "self_normalized")])
def test_selective_layer_agrees_with_the_cpu(cl, path, shared, activation, cost):
    def build():
        lm.manual_seed(12)
        net = lm.Network()
        x0, x1 = net.input("x0", 6), net.input("x1", 3)
        sel = net.input("sel", dtype="selection")
        y = net.input("y", dtype="int32")
        scores = lm.layers.SelectiveLinear([6, 3], 23, activation=activation, path=path, name="out")(x0, x1, sel)
        c = lm.layers.SelectedCrossEntropy() if cost == "ce" else lm.layers.SelfNormalizedCost(0.3)
        net.outputs(loss=c(scores, y, sel), scores=scores)
        net.values["x0"].requires_grad = True
        return net

    rng = np.random.default_rng(13)
    if shared:
        sel, labels = lm.Selection.shared(np.array([3, 5, 7, 11, 0, 22], np.int32)), np.array([11, 5, 0, 5], np.int32)
    else:
        sel = lm.sampled_selection(np.array([2, 4, 8, 1], np.int32), 23, 6, rng=rng)
        labels = np.array([2, 4, 8, 1], np.int32)
    feeds = {"x0": rng.standard_normal((4, 6)).astype(np.float32), "x1": rng.standard_normal((4, 3)).astype(np.float32),
             "sel": sel, "y": labels}
    cpu, dev = build(), build().to(cl)
    want, got = cpu.run(feeds), dev.run(feeds)
    np.testing.assert_allclose(got["loss"], want["loss"], rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(getattr(got["scores"], "values", got["scores"]),
                               getattr(want["scores"], "values", want["scores"]), rtol=1e-4, atol=1e-6)
    for net in (cpu, dev):
        net.forward(feeds)
        net.backward()
    np.testing.assert_allclose(host(dev.grad("x0")), cpu.grad("x0"), rtol=1e-4, atol=1e-6)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        assert (p.grad_rows is None) == (q.grad_rows is None)
        np.testing.assert_allclose(host(q.dense_grad(dev.backend)), p.dense_grad(cpu.backend), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


@pytest.mark.parametrize("norm_first", [False, True])
def test_transformer_layers_agree_with_the_cpu(cl, norm_first):
    """Embedding, positions, RMSNorm, a causal encoder layer (attention, LayerNorm, GELU) and
    pooling: one training step on a ragged batch."""
    def build():
        lm.manual_seed(6)
        net = lm.Network()
        ids, y = net.input("ids", dtype="int32", sequence=True), net.input("y", dtype="int32")
        h = lm.layers.PositionalEmbedding(9, 8)(lm.layers.Embedding(11, 8)(ids))
        h = lm.layers.RMSNorm(8, eps=1e-6)(h)
        h = lm.layers.TransformerEncoderLayer(8, 2, 16, dropout=0.0, activation="gelu", norm_first=norm_first,
                                              causal=True, name="enc")(h)
        logits = Linear(8, 3)(lm.layers.SequencePool("average")(h))
        net.outputs(loss=SoftmaxCrossEntropy()(logits, y))
        return net

    rng = np.random.default_rng(12)
    feeds = {"ids": lm.Sequences.from_list([rng.integers(0, 11, n).astype(np.int32) for n in (3, 1, 9, 4)]),
             "y": rng.integers(0, 3, 4).astype(np.int32)}
    same_training_step(build(), build().to(cl), feeds)


def same_training_step(cpu, dev, feeds):
    """One training step on each: the same loss, every parameter's gradient, and the parameters
    after the update (the loss alone is computed before the update, so it cannot show a wrong
    gradient or update)."""
    losses = []
    for net in (cpu, dev):
        net.forward(feeds, outputs=net.cost_outputs())
        losses.append(net.backward())
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-4)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        if p.grad_pending:
            want = p.dense_grad(cpu.backend)
            np.testing.assert_allclose(host(q.dense_grad(dev.backend)), want, rtol=2e-3,
                                       atol=2e-4 * max(1.0, float(np.abs(want).max())), err_msg=name)
    for net in (cpu, dev):
        lm.optim.SGD(net, lr=0.1).step()  # the gradients of the pass above
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(q.value, p.value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_shipped_language_model_runs_on_the_device(cl):
    """models/python_lm on the device gives the CPU's scores, and trains a step from there."""
    from pathlib import Path
    from lamina.zoo import language
    path = Path(__file__).resolve().parent.parent / "models/python_lm/model.lamina"
    cpu, dev = lm.load(path), lm.load(path).to(cl)
    tok = language.tokenizer(cpu)
    chunks = language.chunk(tok.encode("import os\n\ndef main(argv):\n    return os.path.join(argv[0], 'x')\n"), 48)
    np.testing.assert_allclose(language.perplexity(dev, chunks), language.perplexity(cpu, chunks), rtol=1e-4)
    assert language.continue_code(dev, "import os\n", tokens=8, top_k=1)[0] == \
        language.continue_code(cpu, "import os\n", tokens=8, top_k=1)[0]
    feeds = language.training_feeds(cpu, chunks, 16, np.random.default_rng(0))
    same_training_step(cpu, dev, feeds)


@pytest.mark.parametrize("kind,options", [
    ("Conv3d", dict(kernel_size=3, padding=1)),
    ("Conv3d", dict(kernel_size=2, stride=2, dilation=1, groups=2)),
    ("Conv3d", dict(kernel_size=3, stride=(1, 2, 1), padding=2, dilation=2)),
    ("ConvTranspose3d", dict(kernel_size=3, stride=2, padding=1, output_padding=1)),
    ("ConvTranspose3d", dict(kernel_size=4, stride=2, padding=1, groups=2)),
    ("Conv2d", dict(kernel_size=3, stride=2, padding=1)),
    ("Conv3d", dict(kernel_size=1, groups=2)),
    ("ConvTranspose2d", dict(kernel_size=3, stride=2, padding=0, dilation=2)),
    ("Conv2d", dict(kernel_size=3, stride=2, padding=((1, 0), (0, 2)))),
    ("ConvTranspose3d", dict(kernel_size=3, stride=2, padding=((1, 0), (0, 2), (1, 1)), output_padding=1)),
])
def test_convolutions_agree_with_the_cpu(cl, kind, options):
    nd = 3 if kind.endswith("3d") else 2
    spatial = (5, 6, 4)[:nd] if nd == 3 else (7, 6)

    def build():
        lm.manual_seed(14)
        net = lm.Network()
        x = net.input("x", (4,) + spatial)
        net.outputs(y=getattr(lm.layers, kind)(4, 6, name="conv", **options)(x))
        net.values["x"].requires_grad = True
        return net

    rng = np.random.default_rng(15)
    feeds = {"x": rng.standard_normal((2, 4) + spatial).astype(np.float32)}
    cpu, dev = build(), build().to(cl)
    want, got = cpu.run(feeds)["y"], dev.run(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    g = {"y": rng.standard_normal(want.shape).astype(np.float32)}
    for net in (cpu, dev):
        net.forward(feeds, grad_outputs=["y"])
        net.backward(grad_outputs=g)
    np.testing.assert_allclose(host(dev.grad("x")), cpu.grad("x"), rtol=1e-4, atol=1e-5)
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(host(q.grad), p.grad, rtol=1e-4, atol=1e-4, err_msg=name)


def test_a_convolution_with_its_activation_fused_agrees_with_the_cpu(cl):
    """Inference runs conv -> ReLU -> max pool with the ReLU inside the convolution (the bias and
    the activation as the backend applies them), the pool keeping no positions, and a batch
    norm's ReLU inside the batch norm."""
    def build():
        lm.manual_seed(16)
        net = lm.Network()
        x = net.input("x", (3, 9, 10))
        conv = lm.layers.Conv2d(3, 5, 3, padding=1)(x)
        y = lm.layers.MaxPool2d(2)(lm.layers.Activation("relu")(conv))
        normed = lm.layers.BatchNorm2d(5, frozen_statistics=True)(lm.layers.Conv2d(5, 5, 1)(y))
        net.outputs(y=lm.layers.Activation("relu")(normed))
        return net

    feeds = {"x": np.random.default_rng(17).standard_normal((2, 3, 9, 10)).astype(np.float32)}
    cpu, dev = build(), build().to(cl)
    assert dev.scheduler.plan(False, ("y",)).fused == {"conv2d0": ("relu", 0.01), "batch_norm2d0": ("relu", 0.01)}
    want = cpu.forward(feeds, training=True)["y"]  # unfused, positions kept
    np.testing.assert_allclose(cpu.run(feeds)["y"], want, rtol=0, atol=0)
    np.testing.assert_allclose(dev.run(feeds)["y"], want, rtol=1e-5, atol=1e-6)


def test_shipped_denoiser_runs_on_the_device(cl):
    from pathlib import Path
    from lamina.zoo import denoise
    path = Path(__file__).resolve().parent.parent / "models/denoise3d/model.lamina"
    cpu, dev = lm.load(path), lm.load(path).to(cl)
    clean = denoise.shapes(2, np.random.default_rng(1))
    noisy = denoise.noisy_copy(clean, np.random.default_rng(2))
    np.testing.assert_allclose(dev.run({"noisy": noisy}, ["denoised"])["denoised"],
                               cpu.run({"noisy": noisy}, ["denoised"])["denoised"], rtol=1e-4, atol=1e-5)
    same_training_step(cpu, dev, {"noisy": noisy, "clean": clean})



@pytest.mark.parametrize("kind,options", [
    ("MaxPool3d", dict(kernel_size=2)), ("MaxPool3d", dict(kernel_size=3, stride=2, padding=1)),
    ("AvgPool3d", dict(kernel_size=3, stride=2, padding=1)),
    ("AvgPool3d", dict(kernel_size=3, stride=1, padding=1, count_include_pad=False)),
    ("MaxPool2d", dict(kernel_size=3, stride=2)), ("AvgPool2d", dict(kernel_size=2, padding=1)),
    ("MaxPool3d", dict(kernel_size=3, stride=2, padding=((1, 0), (0, 1), (1, 1)), ceil_mode=True)),
    ("AvgPool2d", dict(kernel_size=3, stride=2, padding=((1, 0), (0, 1)), ceil_mode=True, count_include_pad=False)),
    # dilated windows: the backward gathers over the taps that cover each input
    ("MaxPool3d", dict(kernel_size=2, stride=1, padding=1, dilation=(1, 2, 3))),
    ("MaxPool2d", dict(kernel_size=3, stride=2, padding=1, dilation=2)),
    ("AvgPool2d", dict(kernel_size=(2, 3), stride=(2, 1), padding=(1, 2), dilation=(3, 2), count_include_pad=False)),
    ("AvgPool3d", dict(kernel_size=2, stride=1, dilation=2)),
])
def test_pooling_agrees_with_the_cpu(cl, kind, options):
    nd = 3 if kind.endswith("3d") else 2
    spatial = (5, 6, 7)[:nd] if nd == 3 else (7, 6)

    def build():
        net = lm.Network()
        x = net.input("x", (3,) + spatial)
        net.outputs(y=getattr(lm.layers, kind)(**options)(x))
        net.values["x"].requires_grad = True
        return net

    rng = np.random.default_rng(16)
    feeds = {"x": rng.standard_normal((2, 3) + spatial).astype(np.float32)}
    cpu, dev = build(), build().to(cl)
    want = cpu.run(feeds)["y"]
    np.testing.assert_allclose(dev.run(feeds)["y"], want, rtol=1e-5, atol=1e-6)
    g = {"y": rng.standard_normal(want.shape).astype(np.float32)}
    for net in (cpu, dev):
        net.forward(feeds, grad_outputs=["y"])
        net.backward(grad_outputs=g)
    np.testing.assert_allclose(host(dev.grad("x")), cpu.grad("x"), rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("kind,options", [("MaxPool2d", dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
                                          ("MaxPool3d", dict(kernel_size=2, stride=1, padding=1, dilation=(1, 2, 3)))])
def test_max_pool_indices_agree_with_the_cpu(cl, kind, options):
    """return_indices on the device: the same positions as the CPU's (of tied values the first)."""
    spatial = (5, 6, 7) if kind.endswith("3d") else (7, 6)

    def build():
        net = lm.Network()
        y, indices = getattr(lm.layers, kind)(**options, return_indices=True)(net.input("x", (3,) + spatial))
        return net.outputs(y=y, indices=indices)

    feeds = {"x": np.random.default_rng(17).integers(-2, 3, (2, 3) + spatial).astype(np.float32)}  # ties
    cpu, dev = build(), build().to(cl)
    for want, got in ((cpu.run(feeds), dev.run(feeds)), (cpu.forward(feeds, training=True),
                                                         dev.forward(feeds, training=True))):
        assert host(got["indices"]).dtype == np.int32
        np.testing.assert_array_equal(host(got["indices"]), want["indices"])
        np.testing.assert_array_equal(host(got["y"]), want["y"])


def test_host_arrays_changed_in_place_are_copied_again(cl):
    """Offsets the caller reuses and rewrites between runs reach the device anew."""
    net = lm.Network()
    x = net.input("x", 2, sequence=True)
    net.outputs(y=lm.layers.SequencePool("sum")(x))
    net.to(cl)
    values = np.arange(12, dtype=np.float32).reshape(6, 2)
    starts = np.array([0, 2, 6], np.int32)
    first = net.run({"x": lm.Sequences(values, starts)})["y"]
    starts[1] = 4  # the same array, new offsets
    second = net.run({"x": lm.Sequences(values, starts)})["y"]
    np.testing.assert_array_equal(first, [[2, 4], [28, 32]])
    np.testing.assert_array_equal(second, [[12, 16], [18, 20]])


@pytest.mark.parametrize("kind,options", [
    ("RNN", dict(nonlinearity="tanh", bidirectional=True, num_layers=2)), ("RNN", dict(nonlinearity="relu")),
    ("LSTM", dict(bidirectional=True, num_layers=2)), ("LSTM", dict(reverse=True)),
    ("GRU", dict(bidirectional=True, num_layers=2)),
    ("GRU", dict(linear_before_reset=False, bidirectional=True)),
])
def test_whole_sequence_path_equals_the_step_by_step_path(cl, kind, options, monkeypatch):
    """A recurrence's steps enqueued as one recorded plan by compiled code give what enqueueing
    them one by one from Python gives, bit for bit: outputs, last states and every gradient, over
    ragged sequences with ties and initial states, both directions, stacked. The plans run for
    every cell but GRU's reset-first form, whose steps fill a buffer (it runs step by step)."""
    from lamina.backends import opencl, opencl_plan
    D, L = 2 if options.get("bidirectional") else 1, options.get("num_layers", 1)
    states = 2 if kind == "LSTM" else 1
    rng = np.random.default_rng(3)
    seqs = lm.Sequences.from_list([rng.standard_normal((n, 5)).astype(np.float32) for n in (6, 1, 9, 6, 3, 2)])
    feeds = {"x": seqs, **{f"s{i}": rng.standard_normal((6, L * D, 8)).astype(np.float32) for i in range(states)}}
    grads = {"out": rng.standard_normal((seqs.total_steps, D * 8)).astype(np.float32),
             "last": rng.standard_normal((6, L * D, 8)).astype(np.float32)}
    plans = []
    enqueue = opencl_plan.Plan.enqueue
    monkeypatch.setattr(opencl_plan.Plan, "enqueue", lambda plan, be: (plans.append(plan.steps), enqueue(plan, be)))
    results = []
    for whole in (True, False):
        monkeypatch.setattr(opencl, "WHOLE_SEQUENCE", whole)
        net = recurrent_net(kind, options, 8, 5)[0].to(cl)
        net.forward(feeds, grad_outputs=["out", "last"])
        net.backward(grad_outputs=grads)
        got = net.run(feeds)
        results.append([got["out"].values, got["last"]] + [host(net.grad(name)) for name in feeds]
                       + [host(p.grad) for _, p in net.named_parameters()])
    for got, want in zip(*results):
        np.testing.assert_array_equal(got, want)
    if kind == "GRU" and not options.get("linear_before_reset", True):
        assert plans == []
    else:  # forward and backward of each layer direction, and the inference run's forwards
        assert plans == [seqs.lengths.max() - 1] * (3 * L * D)


def test_a_recorded_plan_refuses_rows_outside_its_arrays(cl):
    """Step rows are checked against the array they index, for every step, before anything is
    recorded or enqueued."""
    from lamina.backends.opencl_plan import StepRows
    a = cl.empty((10, 4), np.float32)
    a[StepRows([0, 4, 6], [4, 2, 4])]  # rows 0..10: inside
    for starts, counts, step in (([0, 4, 7], [4, 2, 4], 2), ([-1, 4], [1, 1], 0), ([0, 4], [4, -1], 1)):
        with pytest.raises(IndexError, match=f"step {step} takes rows"):
            a[StepRows(starts, counts)]


def test_a_training_step_makes_no_transfer_per_time_step(cl):
    """Host <-> device transfers of an LSTM's forward and backward are the batch's own uploads
    (its values and orders) and the loss read back at the start of backward: as many for
    sequences of 40 steps as for sequences of 4, and none read back during the forward."""
    counts = []
    for steps in (4, 40):
        lm.manual_seed(1)
        net = lm.Network()
        x = net.input("x", 6, sequence=True)
        h = lm.layers.LSTM(6, 8, num_layers=2, bidirectional=True)(x)[0]
        net.outputs(loss=lm.layers.SquareError()(lm.layers.Linear(16, 1)(h), net.input("y", 1, sequence=True)))
        net.to(cl)
        rng = np.random.default_rng(steps)
        lengths = [steps, steps - 1, steps // 2, 1]
        feeds = {"x": lm.Sequences.from_list([rng.standard_normal((n, 6)).astype(np.float32) for n in lengths]),
                 "y": lm.Sequences.from_list([rng.standard_normal((n, 1)).astype(np.float32) for n in lengths])}
        before = dict(cl.transfers)
        net.forward(feeds, outputs=net.cost_outputs())
        assert cl.transfers["to_host"] == before["to_host"]
        net.backward()
        counts.append({k: cl.transfers[k] - before[k] for k in ("to_device", "to_host")})
    assert counts[0] == counts[1] and counts[1]["to_host"] == 1, counts


@pytest.mark.parametrize("clip_norm", [None, 1.0])
def test_an_optimizer_step_reads_back_once_and_still_skips_a_nonfinite_gradient(cl, clip_norm):
    """On a device whose reads wait for its queue the optimizer checks every gradient of a step
    with one read (not one per parameter), gives the CPU's update, and a NaN gradient still skips
    the whole step."""
    feeds = dense_feeds()
    cpu, dev = dense_net(), dense_net().to(cl)
    for net in (cpu, dev):
        opt = lm.optim.Adam(net, lr=0.01, clip_norm=clip_norm)
        net.forward(feeds, outputs=net.cost_outputs())
        net.backward()
        before = cl.transfers["to_host"]
        opt.step()
        if net is dev:
            assert cl.transfers["to_host"] - before == 1
    for (name, p), (_, q) in zip(cpu.named_parameters(), dev.named_parameters()):
        np.testing.assert_allclose(q.value, p.value, rtol=1e-4, atol=1e-5, err_msg=name)
    opt = lm.optim.SGD(dev, lr=0.1, clip_norm=clip_norm)
    dev.forward(feeds, outputs=dev.cost_outputs())
    dev.backward()
    first = next(p for _, p in dev.named_parameters())
    cl.fill(first.grad, np.nan)
    values = [p.value.copy() for _, p in dev.named_parameters()]
    opt.step()
    assert opt.skipped_steps == 1 and opt.step_count == 0
    for got, (name, p) in zip(values, dev.named_parameters()):
        np.testing.assert_array_equal(p.value, got, err_msg=name)
