"""3-D (and 2-D) convolution and transposed convolution: a direct-loop numpy reference, float64
gradient checks over odd configurations, PyTorch parity on random configurations, shape errors."""
import itertools

import numpy as np
import pytest

import lamina as lm
from lamina.layers import Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d
from lamina.testing import add_probe_cost, check_gradients, probe_feed


def direct_conv(x, w, b, stride, padding, dilation, groups, padding_end=None):
    """Cross-correlation by explicit loops over every output element (NCDHW, float64); padding
    before each axis, padding_end after it (padding when not given)."""
    N, C = x.shape[:2]
    O, Cg = w.shape[:2]
    k = w.shape[2:]
    padding_end = padding_end or padding
    out = [(n + p + q - d * (kk - 1) - 1) // s + 1
           for n, kk, s, p, q, d in zip(x.shape[2:], k, stride, padding, padding_end, dilation)]
    xp = np.pad(x, [(0, 0), (0, 0)] + list(zip(padding, padding_end)))
    y = np.zeros((N, O) + tuple(out))
    og = O // groups
    for n, o in itertools.product(range(N), range(O)):
        g = o // og
        for pos in itertools.product(*(range(m) for m in out)):
            acc = b[o] if b is not None else 0.0
            for c in range(Cg):
                for kk in itertools.product(*(range(m) for m in k)):
                    idx = tuple(q * s + t * d for q, s, t, d in zip(pos, stride, kk, dilation))
                    acc += w[(o, c) + kk] * xp[(n, g * Cg + c) + idx]
            y[(n, o) + pos] = acc
    return y


def direct_conv_transpose(x, w, b, stride, padding, output_padding, dilation, groups, padding_end=None):
    """Scatter every input element through the kernel (the definition of the transposed conv);
    padding crops the start of each axis, padding_end its end."""
    N, C = x.shape[:2]
    Og = w.shape[1]
    k = w.shape[2:]
    cg = C // groups
    padding_end = padding_end or padding
    out = [(n - 1) * s - p - q + d * (kk - 1) + op + 1
           for n, kk, s, p, q, d, op in zip(x.shape[2:], k, stride, padding, padding_end, dilation, output_padding)]
    y = np.zeros((N, Og * groups) + tuple(out))
    for n, c in itertools.product(range(N), range(C)):
        g = c // cg
        for pos in itertools.product(*(range(m) for m in x.shape[2:])):
            for o in range(Og):
                for kk in itertools.product(*(range(m) for m in k)):
                    idx = tuple(q * s - p + t * d for q, s, p, t, d in zip(pos, stride, padding, kk, dilation))
                    if all(0 <= i < m for i, m in zip(idx, out)):
                        y[(n, g * Og + o) + idx] += x[(n, c) + pos] * w[(c, o) + kk]
    if b is not None:
        y += b.reshape((1, -1) + (1,) * len(out))
    return y


# (layer, in, out, volume, kwargs): odd, non-cubic volumes; kernels 2 and 3; stride 1..3;
# padding 0..2; dilation 1..2; output_padding; groups 1, 2, 4; with and without bias
CASES = [
    (Conv3d, 2, 3, (4, 5, 3), dict(kernel_size=2)),
    (Conv3d, 4, 4, (5, 4, 6), dict(kernel_size=3, stride=(1, 2, 3), padding=(1, 2, 0), groups=2)),
    (Conv3d, 4, 8, (6, 5, 7), dict(kernel_size=(3, 2, 3), stride=2, padding=1, dilation=(2, 1, 1), groups=4, bias=False)),
    (Conv3d, 2, 2, (5, 5, 5), dict(kernel_size=2, stride=3, padding=2, dilation=2)),
    # depth stride 1 runs as depth taps: depth dilation and padding, and output slices no tap reaches
    (Conv3d, 2, 4, (6, 4, 5), dict(kernel_size=(3, 2, 2), stride=(1, 1, 2), padding=(2, 0, 1), dilation=(2, 1, 1), groups=2)),
    (Conv3d, 2, 2, (2, 4, 4), dict(kernel_size=(2, 3, 3), padding=(2, 1, 1))),
    # deep enough for several depth slabs when blocks are small (test_blocked_...)
    (Conv3d, 2, 2, (12, 3, 3), dict(kernel_size=2, padding=(1, 0, 0))),
    (Conv3d, 2, 4, (20, 3, 2), dict(kernel_size=(3, 2, 1), padding=(2, 1, 0), dilation=(2, 1, 1), groups=2)),
    (ConvTranspose3d, 2, 3, (3, 4, 2), dict(kernel_size=2)),
    (ConvTranspose3d, 4, 4, (3, 2, 4), dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2)),
    (ConvTranspose3d, 4, 8, (2, 3, 3), dict(kernel_size=(2, 3, 3), stride=(3, 2, 1), padding=(0, 1, 2),
                                           output_padding=(2, 1, 0), groups=4, bias=False)),
    (ConvTranspose3d, 2, 2, (3, 3, 2), dict(kernel_size=3, stride=1, padding=1, dilation=2, output_padding=1)),
    # width stride 2 in transposed convolutions: kernel widths 1, 4 and 5 (one, two and three
    # taps per parity), odd and even width padding, output channels not whole register blocks,
    # rows longer than one tile, depth/height strides 1..3 with rows no tap reaches
    (ConvTranspose3d, 3, 5, (2, 3, 9), dict(kernel_size=(2, 3, 1), stride=(1, 3, 2), padding=(1, 0, 0),
                                           output_padding=(0, 1, 1))),
    (ConvTranspose3d, 2, 9, (3, 2, 11), dict(kernel_size=(3, 2, 4), stride=2, padding=(2, 1, 1), bias=False)),
    (Conv2d, 4, 6, (5, 7), dict(kernel_size=3, stride=2, padding=1, groups=2)),
    (ConvTranspose2d, 4, 2, (3, 4), dict(kernel_size=3, stride=2, padding=1, output_padding=1, groups=2)),
    (ConvTranspose2d, 4, 4, (5, 13), dict(kernel_size=(4, 5), stride=2, padding=(1, 2), output_padding=1, groups=2)),
    # padding before and after each axis (ONNX's asymmetric pads, TensorFlow's SAME)
    (Conv2d, 3, 4, (7, 6), dict(kernel_size=3, stride=2, padding=((1, 0), (0, 2)))),
    (Conv3d, 2, 4, (5, 4, 6), dict(kernel_size=(3, 2, 3), padding=((0, 1), (1, 1), (2, 0)), groups=2)),
    (ConvTranspose2d, 2, 3, (4, 5), dict(kernel_size=3, stride=2, padding=((1, 0), (0, 2)), output_padding=1)),
]
IDS = [f"{c[0].__name__}-{i}" for i, c in enumerate(CASES)]


def conv_net(case, batch=2, seed=0):
    layer_type, cin, cout, volume, kw = case
    lm.manual_seed(seed)
    net = lm.Network()
    x = net.input("x", (cin,) + volume)
    layer = layer_type(cin, cout, **kw)
    return net, x, layer


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_gradients(case):
    net, x, layer = conv_net(case)
    y = layer(x)
    probe = add_probe_cost(net, y)
    net.astype("float64")
    feeds = {"x": np.random.default_rng(1).standard_normal((2,) + x.spec.shape), probe: probe_feed(net, probe, 2)}
    check_gradients(net, feeds)


def layer_reference(layer, X):
    """The direct-loop result of a convolution layer (plain or transposed) on X, in float64."""
    w = layer.weight.value.astype(np.float64)
    b = layer.bias.value if layer.bias is not None else None
    if layer.transposed:
        return direct_conv_transpose(X, w, b, layer.stride, layer.padding, layer.output_padding, layer.dilation,
                                     layer.groups, layer.padding_end)
    return direct_conv(X, w, b, layer.stride, layer.padding, layer.dilation, layer.groups, layer.padding_end)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_matches_direct_loops(case):
    net, x, layer = conv_net(case)
    net.outputs(y=layer(x))
    net.astype("float64")
    X = np.random.default_rng(2).standard_normal((2,) + x.spec.shape)
    np.testing.assert_allclose(net.run({"x": X})["y"], layer_reference(layer, X), rtol=1e-12, atol=1e-12)


def random_config(rng, transposed, nd):
    groups = int(rng.choice([1, 2, 4]))
    cin, cout = groups * int(rng.integers(1, 4)), groups * int(rng.integers(1, 4))
    k = tuple(int(v) for v in rng.integers(1, 4, nd))
    s = tuple(int(v) for v in rng.integers(1, 4, nd))
    d = tuple(int(v) for v in rng.integers(1, 3, nd))
    p = tuple(int(rng.integers(0, (kk - 1) * dd // 2 + 1)) for kk, dd in zip(k, d))
    kw = dict(kernel_size=k, stride=s, padding=p, dilation=d, groups=groups, bias=bool(rng.integers(0, 2)))
    if transposed:
        kw["output_padding"] = tuple(int(rng.integers(0, max(ss, dd))) for ss, dd in zip(s, d))
    volume = tuple(int(v) for v in rng.integers(4, 9, nd))
    return cin, cout, volume, kw


@pytest.mark.parametrize("transposed", [False, True], ids=["conv", "transposed"])
@pytest.mark.parametrize("nd", [2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_matches_pytorch(transposed, nd, seed):
    import torch  # a test extra: installed by make test, never skipped
    F = torch.nn.functional
    rng = np.random.default_rng(100 + seed)
    cin, cout, volume, kw = random_config(rng, transposed, nd)
    layer_type = {(False, 3): Conv3d, (False, 2): Conv2d, (True, 3): ConvTranspose3d, (True, 2): ConvTranspose2d}[transposed, nd]
    net = lm.Network()
    x = net.input("x", (cin,) + volume)
    layer = layer_type(cin, cout, **kw)
    y = layer(x)
    net.outputs(y=y)
    X = rng.standard_normal((3, cin) + volume).astype(np.float32)
    G = rng.standard_normal((3,) + y.spec.shape).astype(np.float32)
    x.requires_grad = True
    out = net.forward({"x": X}, grad_outputs=["y"])["y"].copy()
    net.backward(grad_outputs={"y": G})
    tx = torch.from_numpy(X).requires_grad_(True)
    tw = torch.from_numpy(layer.weight.value.copy()).requires_grad_(True)
    tb = torch.from_numpy(layer.bias.value.copy()).requires_grad_(True) if layer.bias is not None else None
    fn = {(False, 3): F.conv3d, (False, 2): F.conv2d, (True, 3): F.conv_transpose3d, (True, 2): F.conv_transpose2d}[transposed, nd]
    targs = {k: v for k, v in kw.items() if k not in ("bias", "kernel_size")}
    ty = fn(tx, tw, tb, **targs)
    ty.backward(torch.from_numpy(G))
    tol = dict(rtol=1e-5, atol=1e-5 * float(np.abs(ty.detach().numpy()).max() + 1))
    np.testing.assert_allclose(out, ty.detach().numpy(), **tol)
    np.testing.assert_allclose(net.grad("x"), tx.grad.numpy(), rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(layer.weight.grad, tw.grad.numpy(), rtol=1e-5, atol=1e-4)
    if tb is not None:
        np.testing.assert_allclose(layer.bias.grad, tb.grad.numpy(), rtol=1e-5, atol=1e-4)


def test_configuration_errors_name_the_layer():
    with pytest.raises(ValueError, match=r"Conv3d: in_channels \(6\) and out_channels \(4\) must both be divisible by groups \(4\)"):
        Conv3d(6, 4, 3, groups=4)
    with pytest.raises(ValueError, match="output_padding must be smaller than stride or dilation"):
        ConvTranspose3d(2, 2, 3, stride=2, output_padding=2)
    net = lm.Network()
    x = net.input("x", (2, 3, 3, 3))
    with pytest.raises(lm.GraphError, match=r"layer 'enc' \(Conv3d\): the output would be empty"):
        Conv3d(2, 4, 5, name="enc")(x)
    with pytest.raises(lm.GraphError, match=r"layer 'c' \(Conv3d\): input 0 has 2 channels, expected in_channels=3"):
        Conv3d(3, 4, 1, name="c")(x)
    with pytest.raises(lm.GraphError, match=r"input 0 must be \[C, H, W\] per sample"):
        Conv2d(2, 4, 1)(x)


BLOCKED = [CASES[1], CASES[2], CASES[6], CASES[7], CASES[8], CASES[9], CASES[14]]


@pytest.mark.parametrize("case", BLOCKED, ids=[f"{c[0].__name__}-{c[3]}" for c in BLOCKED])
def test_blocked_column_matrix_gives_the_same_result(case, monkeypatch):
    """vol2col works on blocks of window rows; with tiny blocks (many per sample) the forward
    output and every gradient equal the single-block result."""
    import lamina.backends.columns as columns
    results = []
    for block in (1 << 18, 7):
        monkeypatch.setattr(columns, "COL_BLOCK", block)
        results.append(output_and_gradients(case, batch=2, passes=1))
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)


def output_and_gradients(case, batch, passes):
    """float64 output, input gradient and parameter gradients after `passes` backward passes."""
    net, x, layer = conv_net(case, seed=3)
    y = layer(x)
    net.outputs(y=y)
    net.astype("float64")
    x.requires_grad = True
    rng = np.random.default_rng(4)
    X = rng.standard_normal((batch,) + x.spec.shape)
    G = rng.standard_normal((batch,) + y.spec.shape)
    for _ in range(passes):
        out = net.forward({"x": X}, grad_outputs=["y"])["y"].copy()
        net.backward(grad_outputs={"y": G})
    return [out, net.grad("x").copy()] + [p.grad.copy() for p in net.parameters()]


@pytest.mark.parametrize("case", BLOCKED, ids=[f"{c[0].__name__}-{c[3]}" for c in BLOCKED])
def test_samples_split_between_threads_give_the_one_thread_result(case):
    """The samples of a batch run on separate threads, each adding its own weight-gradient part;
    with 1, 2 and 3 threads over 5 samples (uneven runs) the output and every gradient equal the
    one-thread result, also when the gradients accumulate (beta 1) over two backward passes."""
    results = []
    before = lm.get_num_threads()
    try:
        for threads in (1, 2, 3):
            lm.set_num_threads(threads)
            results.append(output_and_gradients(case, batch=5, passes=2))  # parameter gradients add up
    finally:
        lm.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", BLOCKED, ids=[f"{c[0].__name__}-{c[3]}" for c in BLOCKED])
def test_blocks_of_a_sample_split_between_threads_give_the_one_thread_result(case, monkeypatch):
    """With fewer samples than threads, the threads share each sample's blocks of columns: one
    and two samples over 1, 2 and 3 threads, many blocks a sample, give the one-thread output and
    gradients."""
    import lamina.backends.columns as columns
    monkeypatch.setattr(columns, "COL_BLOCK", 7)
    before = lm.get_num_threads()
    lm.set_conv_algorithm("columns")  # (the CPU's rule takes direct or Winograd for some)
    try:
        for batch in (1, 2):
            results = []
            for threads in (1, 2, 3):
                lm.set_num_threads(threads)
                results.append(output_and_gradients(case, batch=batch, passes=1))
            for other in results[1:]:
                for a, b in zip(results[0], other):
                    np.testing.assert_allclose(b, a, rtol=1e-12, atol=1e-12)
    finally:
        lm.set_num_threads(before)
        lm.set_conv_algorithm("rule")


def test_split_work_covers_the_items_and_restores_kernel_threads():
    import threading
    from lamina.backends.cpu import _kernels, _openblas
    from lamina.threads import split_work
    before = lm.get_num_threads()
    try:
        lm.set_num_threads(3)
        seen, where = {}, {}

        def record(t, items):
            seen[t] = list(items)
            where[t] = (threading.get_ident(), _kernels.get_num_threads())
        assert split_work(7, record) == 3
        assert sorted(sum(seen.values(), [])) == list(range(7)) and all(seen.values())
        # the caller takes run 0 and the others run on pool threads, each single-threaded
        assert where[0][0] == threading.get_ident()
        assert threading.get_ident() not in (where[1][0], where[2][0])
        assert all(w[1] == 1 for w in where.values())
        assert split_work(2, lambda t, items: None) == 2  # never more runs than items
        assert _openblas.get_num_threads() == 1 and _kernels.get_num_threads() == 3
        # a split inside a run stays on that run's thread, in one run
        inner = {}

        def nested(t, items):
            inner[t] = (split_work(5, lambda u, more: None), threading.get_ident())
        split_work(3, nested)
        assert all(runs == 1 for runs, _ in inner.values())

        def failing(t, items):
            if t in (0, 1):
                raise ValueError(f"run {t} failed")
        with pytest.raises(ValueError, match="run 0 failed"):  # the first, after all have finished
            split_work(4, failing)
        assert _openblas.get_num_threads() == 1 and _kernels.get_num_threads() == 3
    finally:
        lm.set_num_threads(before)


def test_direct_input_gradient_adds_to_another_consumers(monkeypatch):
    """Two stride-1 convolutions read the same input: the direct kernel's input gradient
    (the flipped-kernel convolution of dy) of the second adds to the first's (beta 1)."""
    import lamina.backends.cpu.direct as direct
    calls = []
    real = direct.run

    def spy(geom, weight, ctx, which, *args, **kw):
        calls.append(which)
        return real(geom, weight, ctx, which, *args, **kw)
    monkeypatch.setattr(direct, "run", spy)
    net = lm.Network()
    x = net.input("x", (3, 5, 6, 7))
    a = Conv3d(3, 4, 3, padding=1)(x)
    b = Conv3d(3, 4, (3, 2, 3), padding=(1, 1, 2), dilation=(1, 1, 2))(x)
    net.astype("float64")
    probes = [add_probe_cost(net, v) for v in (a, b)]
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 3, 5, 6, 7))}
    for seed, name in enumerate(probes, 1):
        feeds[name] = probe_feed(net, name, 3, seed=seed)
    check_gradients(net, feeds)
    assert "input grad" in calls and "forward" in calls


def test_spin_until_sees_a_count_made_by_another_thread():
    import threading
    from lamina.backends.cpu import _kernels
    counter = np.zeros(1, np.int64)
    assert not _kernels.spin_until(counter, 1, 1e-4)  # nothing counts: gives up after the time
    worker = threading.Thread(target=lambda: [_kernels.count_up(counter) for _ in range(3)])
    worker.start()
    assert _kernels.spin_until(counter, 3, 10.0)
    worker.join()
    assert counter[0] == 3
    with pytest.raises(ValueError, match="spin_until: counter must hold one value, found 2"):
        _kernels.spin_until(np.zeros(2, np.int64), 1, 0.0)
