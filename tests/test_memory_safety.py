"""Compiled kernels never read or write out of bounds, whatever the caller passes.

Every index-taking kernel of every backend gets ids at -1, at the bound, and at 2**31 - 1, and
must refuse them with an error naming the kernel and the argument, leaving its outputs alone.
Then the layer-level ways around a check: arrays changed after they were validated (a
Selection's columns, embedding ids between forward and backward, a Sequences' offsets), labels
out of range on every backend, and integer narrowing."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.checks import IndexRangeError
from lamina.backends.cpu import CPUBackend
from lamina.backends.reference import ReferenceBackend
from lamina.layers import Embedding, Linear, SelectiveLinear, SoftmaxCrossEntropy

from conftest import BLAS_PROVIDERS, OPENCL_DEVICES, stable_rng

BAD = [-1, "bound", 2 ** 31 - 1]


def raw_backends():
    """Backends driven directly: float data on the backend, index arrays on the host (as the
    layers pass them)."""
    found = {**{f"cpu-{blas}": CPUBackend(blas=blas) for blas in BLAS_PROVIDERS}, "reference": ReferenceBackend()}
    if OPENCL_DEVICES:
        from lamina.backends.opencl import OpenCLBackend, devices
        found["opencl"] = OpenCLBackend(devices().index(OPENCL_DEVICES[0]))
    return found


BACKENDS = raw_backends()


@pytest.fixture(params=sorted(BACKENDS))
def be(request):
    return BACKENDS[request.param]


def put(be, a):
    return be.from_host(np.ascontiguousarray(a)) if be.name == "opencl" else np.array(a)


def host(be, a):
    return be.to_host(a) if be.name == "opencl" else a


def bad_value(bad, bound):
    return bound if bad == "bound" else bad


def spoil(ids, bad, bound, at=1):
    ids = np.array(ids, np.int32)
    ids[at] = bad_value(bad, bound)
    return ids


def refused(be, call, *outputs):
    """call() raises IndexRangeError and leaves every output as it was."""
    before = [np.array(host(be, o), copy=True) for o in outputs]
    with pytest.raises(IndexRangeError):
        call()
    for o, b in zip(outputs, before):
        np.testing.assert_array_equal(host(be, o), b)


R, C = 6, 5  # rows and columns of the indexed arrays


def data(be, *shape, seed=0):
    return put(be, stable_rng("data", shape, seed).standard_normal(shape))


@pytest.mark.parametrize("bad", BAD)
def test_row_kernels(be, bad):
    src, dst = data(be, R, C), data(be, 3, C, seed=1)
    ids = spoil([0, 2, 4], bad, R)
    refused(be, lambda: be.gather_rows(src, ids, dst), dst)
    refused(be, lambda: be.scatter_rows(dst, spoil([0, 2, 4], bad, R), src), src)
    refused(be, lambda: be.scatter_add_rows(dst, ids, src), src)
    refused(be, lambda: be.fill_rows(src, ids, 0.0), src)


@pytest.mark.parametrize("bad", BAD)
def test_row_updates(be, bad):
    p, g, m, v = (data(be, R, C, seed=s) for s in range(4))
    rows = spoil([1, 3], bad, R)
    refused(be, lambda: be.sgd_update_rows(p, g, v, rows, 0.1, momentum=0.9), p, v)
    refused(be, lambda: be.adagrad_update_rows(p, g, v, rows, 0.1, 1e-8), p, v)
    refused(be, lambda: be.adam_update_rows(p, g, m, v, rows, 0.1, 0.9, 0.999, 1e-8, 1), p, m, v)


@pytest.mark.parametrize("bad", BAD)
def test_resample_taps(be, bad):
    x, y = data(be, 2, R, 3), data(be, 2, 4, 3, seed=1)
    taps = np.zeros((4, 2), np.int32)
    taps[2, 1] = bad_value(bad, R)
    weights = np.full((4, 2), 0.5)
    refused(be, lambda: be.resample_axis(x, taps, weights, y), y)
    refused(be, lambda: be.resample_axis_backward(y, taps, weights, x, 0.0), x)


@pytest.mark.parametrize("bad", BAD)
def test_attention_offsets(be, bad):
    """An offset out of the rows (or going back) would make the kernels read and write other
    rows' heads."""
    qkv, out, lse = data(be, R, 6), data(be, R, 2, seed=1), data(be, R, 1, seed=2)
    starts = spoil([0, 2, 4, R], bad, R + 1)
    refused(be, lambda: be.attention(qkv, starts, 1, 1.0, False, out, lse), out, lse)
    dqkv = data(be, R, 6, seed=3)
    refused(be, lambda: be.attention_backward(qkv, out, lse, out, starts, 1, 1.0, False, dqkv), dqkv)


@pytest.mark.parametrize("bad", BAD)
def test_softmax_cross_entropy_labels(be, bad):
    x, probs, cost = data(be, 3, C), data(be, 3, C, seed=1), data(be, 3, seed=2)
    labels = spoil([0, 1, 2], bad, C)
    refused(be, lambda: be.softmax_cross_entropy(x, labels, None, probs, cost), probs, cost)
    dx = data(be, 3, C, seed=3)
    refused(be, lambda: be.softmax_cross_entropy_backward(probs, labels, None, cost, dx), dx)


@pytest.mark.parametrize("bad", BAD)
def test_selection_kernels(be, bad):
    rows, width = 3, 7
    starts = np.array([0, 2, 3, 5], np.int32)
    cols = spoil([1, 4, 6, 0, 2], bad, width)
    full, out = data(be, rows, width), data(be, 5, seed=1)
    refused(be, lambda: be.gather_entries(full, starts, cols, False, out), out)
    refused(be, lambda: be.scatter_entries(out, starts, cols, False, full), full)
    b = data(be, width, seed=2)
    refused(be, lambda: be.add_selected_bias(out, b, cols), out)
    # the per-column grouping: a column id, an entry or a row out of range
    good = lm.Selection.per_row(starts, np.array([1, 4, 6, 0, 2], np.int32)).by_column(width)
    x, w = data(be, rows, 4, seed=3), data(be, width, 4, seed=4)
    for part, bound in ((0, width), (2, 5), (3, rows)):
        spoiled = [np.array(a) for a in good]
        spoiled[part] = spoil(spoiled[part], bad, bound, at=0)
        refused(be, lambda: be.selected_dots(x, w, tuple(spoiled), out), out)
        dx, dw = data(be, rows, 4, seed=5), data(be, width, 4, seed=6)
        refused(be, lambda: be.selected_backward(out, x, w, tuple(spoiled), dx=dx, dw=dw), dx, dw)


@pytest.mark.parametrize("bad", BAD)
def test_segment_positions(be, bad):
    starts = np.array([0, 2, 3, 5], np.int32)
    z, probs, cost = data(be, 5), data(be, 5, seed=1), data(be, 3, seed=2)
    pos = spoil([0, 2, 3], bad, 5)  # also out of its own row where it lands inside the array
    refused(be, lambda: be.segment_cross_entropy(z, starts, pos, None, None, probs, cost), probs, cost)
    o = put(be, np.abs(host(be, z)) + 0.1)
    refused(be, lambda: be.segment_self_normalized(o, starts, pos, 0.1, None, cost), cost)


def test_a_position_in_another_row_is_refused(be):
    starts = np.array([0, 2, 3, 5], np.int32)
    z, probs, cost = data(be, 5), data(be, 5, seed=1), data(be, 3, seed=2)
    pos = np.array([0, 3, 3], np.int32)  # row 1 owns only entry 2
    refused(be, lambda: be.segment_cross_entropy(z, starts, pos, None, None, probs, cost), probs, cost)


@pytest.mark.parametrize("bad", [-1, "bound", 2 ** 31 - 1])
def test_sequence_offsets(be, bad):
    x, out = data(be, 6, C), data(be, 2, C, seed=1)
    argmax = put(be, np.zeros((2, C), np.int32))
    starts = np.array([0, 4, 6], np.int32)
    starts[1] = bad_value(bad, 6 + 1)
    refused(be, lambda: be.sequence_pool("sum", x, starts, out, argmax), out)
    y = data(be, 6, seed=2)
    refused(be, lambda: be.sequence_softmax(data(be, 6, seed=3), starts, y), y)


@pytest.mark.parametrize("bad", BAD)
def test_max_pool_argmax(be, bad):
    if be.name == "opencl":
        pytest.skip("the OpenCL kernel compares positions with argmax; it never dereferences one")
    dy = data(be, 1, 1, 2, 2, 2)
    dx = data(be, 1, 1, 4, 4, 4, seed=1)
    argmax = np.zeros((1, 8), np.int32)
    argmax[0, 3] = bad_value(bad, 64)
    refused(be, lambda: be.max_pool_backward(dy, argmax, dx, window=((2, 2, 2), (2, 2, 2), (0, 0, 0))), dx)


# ---------------------------------------------------------------- through the layers

DEVICES = ["cpu"] + (["opencl"] if OPENCL_DEVICES else [])


def classifier(device, classes=4):
    net = lm.Network()
    ids, y = net.input("ids", dtype="int32"), net.input("y", dtype="int32")
    logits = Linear(3, classes, name="fc")(Embedding(10, 3, name="emb")(ids))
    net.outputs(loss=SoftmaxCrossEntropy(name="xent")(logits, y), logits=logits)
    return net.to(device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [4, 2 ** 30, -1, 2 ** 31 - 1])
def test_labels_out_of_range_are_refused_on_every_backend(device, bad):
    net = classifier(device)
    y = np.array([0, bad, 1], np.int32)
    with pytest.raises(lm.InputError, match=rf"layer 'xent'.*labels \(input 1\) must lie in \[0, 4\), "
                                            rf"found {bad} at row 1"):
        net.forward({"ids": np.array([1, 2, 3], np.int32), "y": y})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("bad", [-1, 10, 2 ** 31 - 1])
def test_embedding_ids_out_of_range_are_refused(device, bad):
    net = classifier(device)
    with pytest.raises(lm.InputError, match=rf"layer 'emb'.*ids must lie in \[0, 10\), found {bad} at row 2"):
        net.run({"ids": np.array([1, 2, bad], np.int32)})


def dense_grad(net, p):
    """A parameter's gradient as a full host array (a sparse one's untouched rows are zero)."""
    return np.array(net.backend.to_host(p.dense_grad(net.backend)))


@pytest.mark.parametrize("device", DEVICES)
def test_ids_changed_between_forward_and_backward_are_not_read(device):
    """The network reads the snapshot it checked, not the caller's array."""
    feeds = {"ids": np.array([1, 2, 3], np.int32), "y": np.array([0, 1, 2], np.int32)}
    lm.manual_seed(0)
    net = classifier(device)
    net.forward(dict(feeds))
    net.backward()
    expected = {n: dense_grad(net, p) for n, p in net.named_parameters()}
    lm.manual_seed(0)
    net = classifier(device)
    ids, labels = feeds["ids"].copy(), feeds["y"].copy()
    net.forward({"ids": ids, "y": labels})
    ids[:] = [2 ** 31 - 1, -5, 10]  # out of range now: backward must not see it
    labels[:] = 2 ** 30
    net.backward()
    for n, p in net.named_parameters():
        np.testing.assert_array_equal(dense_grad(net, p), expected[n], err_msg=n)


def test_selection_arrays_cannot_be_changed_after_validation():
    sel = lm.Selection.per_row(np.array([0, 2, 3], np.int32), np.array([1, 4, 2], np.int32))
    for a in (sel.columns, sel.starts(2)):
        with pytest.raises(ValueError, match="read-only"):
            a[0] = 10 ** 6
        with pytest.raises(ValueError):
            a.flags.writeable = True
    with pytest.raises(AttributeError):
        sel.columns = np.array([9, 9, 9], np.int32)
    shared = lm.Selection.shared(np.array([3, 1], np.int32))
    assert not shared.starts(4).flags.writeable
    assert all(not a.flags.writeable for a in sel.by_column(5))


@pytest.mark.parametrize("device", DEVICES)
def test_selection_scores_follow_the_selection_fed(device):
    """Two selections over one network: the cached per-column grouping belongs to each
    selection, never to a column list that changed under it."""
    net = lm.Network()
    h, sel = net.input("h", 4), net.input("sel", dtype="selection")
    layer = SelectiveLinear(4, 9, name="out")
    net.outputs(scores=layer(h, sel))
    net.to(device)
    x = stable_rng("sel").standard_normal((2, 4)).astype(np.float32)
    w, b = layer.params["weight"].value, layer.params["bias"].value
    for cols in ([1, 4, 2], [8, 0, 0]):
        s = lm.Selection.per_row(np.array([0, 2, 3], np.int32), np.array(cols, np.int32))
        got = net.run({"h": x, "sel": s})["scores"].values
        rows = [0, 0, 1]
        np.testing.assert_allclose(got, [x[r] @ w[c] + b[c] for r, c in zip(rows, cols)], rtol=1e-5)


def test_sequence_offsets_changed_after_construction_are_refused():
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    net.outputs(h=lm.layers.LSTM(3, 4)(Embedding(10, 3)(ids))[0])
    seqs = lm.Sequences(np.array([1, 2, 3, 4], np.int32), np.array([0, 3, 4], np.int32))
    net.run({"ids": seqs})
    seqs.starts[1] = 10 ** 6
    with pytest.raises(lm.InputError, match="input 'ids': starts must not decrease"):
        net.run({"ids": seqs})


def test_fuzzed_index_arguments(be):
    """Random ids, in and out of range (and the int32 extremes), through the row kernels: in range
    they give the reference's answer, out of range an IndexRangeError with the output untouched."""
    rng = stable_rng("fuzz", be.name)
    ref = ReferenceBackend()
    kernels = {
        "gather_rows": lambda b, src, dst, ids: b.gather_rows(src, ids, dst),
        "scatter_add_rows": lambda b, src, dst, ids: b.scatter_add_rows(dst[:len(ids)], ids, src),
        "fill_rows": lambda b, src, dst, ids: b.fill_rows(src, ids, 0.5),
        "sgd_update_rows": lambda b, src, dst, ids: b.sgd_update_rows(src, src, None, ids, 0.1),
    }
    outcomes = {"ran": 0, "refused": 0}
    for trial in range(120):
        rows = int(rng.integers(1, 9))
        name = list(kernels)[trial % len(kernels)]
        ids = rng.integers(0, rows, size=int(rng.integers(1, 6)))
        if name == "sgd_update_rows":  # its rows are distinct (a sparse gradient's rows)
            ids = np.unique(ids)
        if trial % 2:  # half of the trials: one id out of range, anywhere
            ids[rng.integers(0, len(ids))] = rng.choice([-3, -1, rows, rows + 2, 2 ** 31 - 1, -2 ** 31])
        ids = ids.astype(np.int32)
        src = stable_rng("fuzz-data", trial).standard_normal((rows, 3))
        dst = stable_rng("fuzz-out", trial).standard_normal((len(ids), 3))
        mine = [put(be, src), put(be, dst)]
        if ids.min() >= 0 and ids.max() < rows:
            kernels[name](be, *mine, ids)
            expected = [src.copy(), dst.copy()]
            kernels[name](ref, *expected, ids)
            for got, want in zip(mine, expected):
                np.testing.assert_allclose(host(be, got), want, rtol=1e-12, err_msg=f"{name} {ids}")
            outcomes["ran"] += 1
        else:
            refused(be, lambda: kernels[name](be, *mine, ids), *mine)
            outcomes["refused"] += 1
    assert min(outcomes.values()) > 20


def test_index_ranges_are_found_in_one_pass():
    """check_index takes an int32 array's smallest and largest entries from one compiled pass
    (others go through numpy): both agree with numpy, and a bad entry is named either way."""
    from lamina.backends.cpu import _kernels
    from lamina.backends.checks import check_index
    rng = np.random.default_rng(5)
    for n in (1, 2, 7, 1000):
        ids = rng.integers(-50, 50, n).astype(np.int32)
        assert _kernels.index_range(ids) == (ids.min(), ids.max())
    with pytest.raises(ValueError, match="empty"):
        _kernels.index_range(np.zeros(0, np.int32))
    for ids in (np.array([0, 5, 9, 10, 3], np.int32), np.array([0, 5, 9, 10, 3], np.int64),
                np.array([0, 9, 5, 9, 10, 9, 3, 9], np.int32)[::2]):
        with pytest.raises(IndexRangeError, match=r"must lie in \[0, 10\), found 10 at position"):
            check_index("kernel", "ids", ids, 10)
        check_index("kernel", "ids", ids, 11)
    with pytest.raises(IndexRangeError, match=r"must lie in \[1, 10\), found 0 at position 0"):
        check_index("kernel", "ids", np.array([0, 1], np.int32), 10, low=1)
