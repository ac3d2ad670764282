"""The selective fully-connected layer, its costs, selections, sampled softmax and top-k: kernels
against the numpy reference, outputs against a full Linear, float64 gradient checks on every
path, sparse gradients and row updates, label positions, and a sampled-softmax training run."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.reference import ReferenceBackend
from lamina.errors import GraphError, InputError
from lamina.layers import SelectedCrossEntropy, SelectiveLinear, SelfNormalizedCost, SoftmaxCrossEntropy
from lamina.testing import check_gradients

REF = ReferenceBackend()
OUT = 23
ROW_LISTS = [[1, 2, 3], [4], [5, 6, 7, 8, 22], [9, 1]]
LABELS = np.array([2, 4, 8, 1], np.int32)
SHARED = np.array([3, 5, 7, 11, 0], np.int32)
SHARED_LABELS = np.array([11, 5, 0, 5], np.int32)  # a label repeats across rows


def selection(shared):
    return (lm.Selection.shared(SHARED), SHARED_LABELS) if shared else (lm.Selection.from_lists(ROW_LISTS), LABELS)


def entries_of(sel, rows):
    """(row, column) of each entry, the plain way."""
    starts = sel.starts(rows)
    row = np.repeat(np.arange(rows), np.diff(starts))
    col = np.tile(sel.columns, rows) if sel.is_shared else sel.columns
    return row, col


def build(in_features=(6,), bias=True, activation="linear", path="auto", cost="ce", sequence=False):
    net = lm.Network()
    xs = [net.input(f"x{i}", n, sequence=sequence) for i, n in enumerate(in_features)]
    sel = net.input("sel", dtype="selection")
    y = net.input("y", dtype="int32", sequence=sequence)
    multi = list(in_features) if len(in_features) > 1 else in_features[0]
    layer = SelectiveLinear(multi, OUT, bias=bias, activation=activation, path=path, name="out")
    scores = layer(*xs, sel)
    cost_layer = SelectedCrossEntropy() if cost == "ce" else SelfNormalizedCost(alpha=0.3)
    net.outputs(scores=scores, loss=cost_layer(scores, y, sel))
    return net, layer


def feeds_for(net, shared, in_features=(6,), seed=0):
    rng = np.random.default_rng(seed)
    sel, labels = selection(shared)
    feeds = {f"x{i}": rng.standard_normal((4, n)).astype(net.dtype) for i, n in enumerate(in_features)}
    feeds.update(sel=sel, y=labels)
    return feeds


def full_scores(layer, feeds, n_inputs):
    z = sum(feeds[f"x{i}"].astype(np.float64) @ layer.params[w].value.T.astype(np.float64)
            for i, w in zip(range(n_inputs), layer.weight_names))
    return z + (layer.bias.value if layer.has_bias else 0)


# ---------------------------------------------------------------- kernels

# (the second: rows of whole vector blocks and a tail, and enough entries for the threads to share)
@pytest.mark.parametrize("rows,n,out,most", [(9, 33, 40, 12), (300, 200, 500, 60)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_selective_kernels(backend, dtype, rows, n, out, most):
    rng = np.random.default_rng(5)
    lists = [rng.integers(0, out, rng.integers(1, most)).astype(np.int32) for _ in range(rows)]
    sel = lm.Selection.from_lists(lists)
    starts, cols = sel.starts(rows), sel.columns
    nnz = len(cols)
    x = rng.standard_normal((rows, n)).astype(dtype)
    w = rng.standard_normal((out, n)).astype(dtype)
    g = rng.standard_normal(nnz).astype(dtype)
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)
    by_column = sel.by_column(out)
    for beta in (0.0, 1.0):
        start = np.full(nnz, np.nan, dtype) if beta == 0 else rng.standard_normal(nnz).astype(dtype)
        got, want = start.copy(), start.copy()
        backend.selected_dots(x, w, by_column, got, beta)
        REF.selected_dots(x, w, by_column, want, beta)
        np.testing.assert_allclose(got, want, **tol)
        # input and weight gradients, together and alone; the weight gradient writes the
        # selected rows only
        for want_dx, want_dw in ((True, True), (True, False), (False, True)):
            runs = []
            for be in (backend, REF):
                dx = (np.full((rows, n), np.nan, dtype) if beta == 0 else x.copy()) if want_dx else None
                dw = w.copy() if want_dw else None
                be.selected_backward(g, x, w, by_column, dx, beta, dw, beta)
                runs.append((dx, dw))
            (dx, dw), (dx_ref, dw_ref) = runs
            if want_dx:
                np.testing.assert_allclose(dx, dx_ref, **tol)
            if want_dw:
                np.testing.assert_allclose(dw, dw_ref, **tol)
                untouched = np.setdiff1d(np.arange(out), cols)
                np.testing.assert_array_equal(dw[untouched], w[untouched])
        b = w[:, 0].copy()
        got_b, want_b = b.copy(), b.copy()
        backend.selected_bias_grad(g, by_column, got_b, beta)
        REF.selected_bias_grad(g, by_column, want_b, beta)
        np.testing.assert_allclose(got_b, want_b, **tol)
    # the CSC grouping itself: every entry once, by increasing column, rows right
    columns, bucket, entries, entry_rows = by_column
    np.testing.assert_array_equal(columns, np.unique(cols))
    np.testing.assert_array_equal(np.sort(entries), np.arange(nnz))
    np.testing.assert_array_equal(cols[entries], np.repeat(columns, np.diff(bucket)))
    np.testing.assert_array_equal(entry_rows, np.repeat(np.arange(rows), np.diff(starts))[entries])
    # dense-path gather and scatter, per-row and shared
    full = rng.standard_normal((rows, out)).astype(dtype)
    for shared_cols, shared in ((cols, False), (np.array([4, 0, 4, 39], np.int32), True)):
        st = starts if not shared else np.arange(rows + 1, dtype=np.int32) * 4
        k = st[-1]
        got, want = np.full(k, np.nan, dtype), np.zeros(k, dtype)
        backend.gather_entries(full, st, shared_cols, shared, got)
        REF.gather_entries(full, st, shared_cols, shared, want)
        np.testing.assert_array_equal(got, want)
        gg = rng.standard_normal(k).astype(dtype)
        got_f, want_f = np.full_like(full, np.nan), full.copy()
        backend.scatter_entries(gg, st, shared_cols, shared, got_f)
        REF.scatter_entries(gg, st, shared_cols, shared, want_f)
        np.testing.assert_allclose(got_f, want_f, **tol)
    got = rng.standard_normal(nnz).astype(dtype)
    want = got.copy()
    backend.add_selected_bias(got, w[:, 1].copy(), cols)
    REF.add_selected_bias(want, w[:, 1].copy(), cols)
    np.testing.assert_allclose(got, want, **tol)


# (odd widths pad their last pair; 200 and 330: whole blocks of vectors and a tail; 300 rows: threads share)
@pytest.mark.parametrize("rows,n,out,most", [(9, 33, 40, 12), (300, 200, 500, 60), (40, 330, 90, 20)])
def test_selective_products_in_bfloat16(backend, rows, n, out, most):
    """selected_dots_in and selected_backward_in in bfloat16: the float64 products of x and w
    rounded to bfloat16 (the gradient unrounded) within float32 summation of their terms, and not
    float32's products."""
    from lamina.precision import round_bfloat16
    rng = np.random.default_rng(6)
    lists = [rng.integers(0, out, rng.integers(1, most)).astype(np.int32) for _ in range(rows)]
    by_column = lm.Selection.from_lists(lists).by_column(out)
    nnz = len(by_column[2])
    x, w = rng.standard_normal((rows, n)).astype(np.float32), rng.standard_normal((out, n)).astype(np.float32)
    g = rng.standard_normal(nnz).astype(np.float32)
    xr, wr = round_bfloat16(x), round_bfloat16(w)

    def exact(g, x, w):  # (float64 dots, dx, dw of these operands)
        dots, dx, dw = np.empty(nnz), np.zeros((rows, n)), np.zeros((out, n))
        REF.selected_dots(x.astype(np.float64), w.astype(np.float64), by_column, dots)
        REF.selected_backward(g.astype(np.float64), x.astype(np.float64), w.astype(np.float64), by_column, dx, 0.0,
                              dw, 0.0)
        return dots, dx, dw

    want, size = exact(g, xr, wr), exact(np.abs(g), np.abs(xr), np.abs(wr))
    terms = max(n, most, max(np.diff(by_column[1])))
    for beta in (0.0, 0.5):
        dots = np.full(nnz, np.nan, np.float32) if beta == 0 else np.ones(nnz, np.float32)
        backend.selected_dots_in("bfloat16", x, w, by_column, dots, beta)
        dx = np.full((rows, n), np.nan, np.float32) if beta == 0 else np.ones((rows, n), np.float32)
        dw = np.full((out, n), 7.0, np.float32)
        backend.selected_backward_in("bfloat16", g, x, w, by_column, dx, beta, dw, beta)
        chosen = by_column[0]
        for got, exact_value, scale in ((dots, want[0] + beta, size[0]), (dx, want[1] + beta, size[1]),
                                        (dw[chosen], want[2][chosen] + 7 * beta, size[2][chosen])):
            assert np.all(np.abs(got - exact_value) <= (terms + 2) * 2.0 ** -24 * (scale + beta * 7) + 1e-30)
        untouched = np.setdiff1d(np.arange(out), chosen)
        np.testing.assert_array_equal(dw[untouched], 7.0)
    float32 = np.empty(nnz, np.float32)
    backend.selected_dots(x, w, by_column, float32)
    assert np.abs(dots - 0.5 - float32).max() > 1e-4 * np.abs(float32).max()  # (bfloat16's products, not these)
    with pytest.raises(ValueError, match="precision must be float32 or bfloat16"):
        backend.selected_dots_in("int8", x, w, by_column, dots)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("shifted", [False, True])
def test_segment_cost_kernels(backend, dtype, weighted, shifted):
    rng = np.random.default_rng(6)
    sel, labels = selection(False)
    starts = sel.starts(4)
    pos = sel.label_entries(labels)
    nnz = len(sel.columns)
    z = (3 * rng.standard_normal(nnz)).astype(dtype)
    o = np.exp(z)
    w = rng.random(4).astype(dtype) if weighted else None
    shift = rng.standard_normal(nnz).astype(dtype) if shifted else None
    dcost = rng.standard_normal(4).astype(dtype)
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-13)
    results = []
    for be in (backend, REF):
        probs, cost, cost2 = np.empty(nnz, dtype), np.empty(4, dtype), np.empty(4, dtype)
        be.segment_cross_entropy(z, starts, pos, shift, w, probs, cost)
        dz = np.ones(nnz, dtype)
        be.segment_cross_entropy_backward(probs, starts, pos, w, dcost, dz, 1.0)
        be.segment_self_normalized(o, starts, pos, 0.2, w, cost2)
        do = np.full(nnz, np.nan, dtype)
        be.segment_self_normalized_backward(o, starts, pos, 0.2, w, dcost, do)
        results.append((probs, cost, dz, cost2, do))
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, **tol)
    # the plain formulas, row by row
    for i in range(4):
        sl = slice(starts[i], starts[i + 1])
        s = z[sl].astype(np.float64) - (shift[sl] if shifted else 0)
        wi = w[i] if weighted else 1.0
        ce = wi * (np.log(np.exp(s).sum()) - s[pos[i] - starts[i]])
        total = o[sl].astype(np.float64).sum()
        sn = wi * (-np.log(o[pos[i]]) + np.log(total) + 0.2 * np.log(total) ** 2)
        np.testing.assert_allclose(results[0][1][i], ce, **tol)
        np.testing.assert_allclose(results[0][3][i], sn, rtol=tol["rtol"] * 10)


# ---------------------------------------------------------------- outputs

@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("in_features,bias", [((6,), True), ((6,), False), ((6, 3, 5), True)])
def test_selected_scores_equal_the_full_layer(path, shared, in_features, bias):
    net, layer = build(in_features, bias=bias, path=path)
    feeds = feeds_for(net, shared, in_features)
    got = net.run({k: v for k, v in feeds.items() if k != "y"}, ["scores"])["scores"]
    full = full_scores(layer, feeds, len(in_features))
    sel = feeds["sel"]
    if shared:
        assert got.shape == (4, len(SHARED))
        np.testing.assert_allclose(got, full[:, SHARED], rtol=2e-6, atol=2e-6)
    else:
        assert isinstance(got, lm.Sequences)
        np.testing.assert_array_equal(got.starts, sel.starts(4))
        row, col = entries_of(sel, 4)
        np.testing.assert_allclose(got.values, full[row, col], rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("activation", ["exponential", "softmax"])
def test_selected_activations(activation):
    net, layer = build(activation=activation)
    feeds = feeds_for(net, False)
    got = net.run({k: v for k, v in feeds.items() if k != "y"}, ["scores"])["scores"]
    row, col = entries_of(feeds["sel"], 4)
    z = full_scores(layer, feeds, 1)[row, col]
    if activation == "exponential":
        want = np.exp(z)
    else:
        want = np.concatenate([np.exp(s) / np.exp(s).sum() for s in np.split(z, feeds["sel"].starts(4)[1:-1])])
    np.testing.assert_allclose(got.values, want, rtol=2e-6)


def test_without_selection_it_is_linear():
    net = lm.Network()
    x = net.input("x", 6)
    layer = SelectiveLinear(6, OUT, activation="softmax")
    net.outputs(y=layer(x))
    X = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    z = X @ layer.weight.value.T + layer.bias.value
    want = np.exp(z - z.max(1, keepdims=True))
    np.testing.assert_allclose(net.run({"x": X})["y"], want / want.sum(1, keepdims=True), rtol=2e-6)


def test_sequence_rows():
    """Rows of a sequence batch (an LSTM's steps) are scored like any rows."""
    net, layer = build(sequence=True)
    rng = np.random.default_rng(1)
    x = lm.Sequences(rng.standard_normal((4, 6)).astype(np.float32), np.array([0, 3, 4], np.int32))
    sel, labels = selection(True)
    out = net.run({"x0": x, "sel": sel, "y": lm.Sequences(labels, x.starts)})
    full = x.values @ layer.weight.value.T + layer.bias.value
    np.testing.assert_allclose(out["scores"], full[:, SHARED], rtol=2e-6, atol=2e-6)
    logp = full[:, SHARED] - np.log(np.exp(full[:, SHARED]).sum(1, keepdims=True))
    want = -logp[np.arange(4), [list(SHARED).index(l) for l in labels]]
    np.testing.assert_allclose(out["loss"].values, want, rtol=1e-5)


# ---------------------------------------------------------------- gradients

@pytest.mark.parametrize("path", ["sparse", "dense"])
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("activation,cost", [("linear", "ce"), ("exponential", "self_normalized"),
                                             ("softmax", "ce")])
def test_gradients(path, shared, activation, cost):
    in_features = (6, 3)
    net, _ = build(in_features, activation=activation, path=path, cost=cost)
    net.astype("float64")
    check_gradients(net, feeds_for(net, shared, in_features))


@pytest.mark.parametrize("shared", [False, True])
def test_gradients_with_logq_weights_and_no_bias(shared):
    net = lm.Network()
    x = net.input("x0", 6)
    sel_in = net.input("sel", dtype="selection")
    y = net.input("y", dtype="int32")
    w = net.input("w", ())
    scores = SelectiveLinear(6, OUT, bias=False)(x, sel_in)
    net.outputs(loss=SelectedCrossEntropy()(scores, y, sel_in, w))
    net.astype("float64")
    rng = np.random.default_rng(3)
    sel, labels = selection(shared)
    sel = lm.Selection(sel.columns, None if shared else sel.starts(4), rng.standard_normal(len(sel.columns)))
    check_gradients(net, {"x0": rng.standard_normal((4, 6)), "sel": sel, "y": labels, "w": rng.random(4)})


def test_sparse_gradient_is_the_dense_one_on_the_selected_rows():
    grads = {}
    for path in ("sparse", "dense"):
        lm.manual_seed(7)
        net, layer = build((6, 3), path=path)
        net.forward(feeds_for(net, False, (6, 3)))
        net.backward()
        grads[path] = layer
    sparse, dense = grads["sparse"], grads["dense"]
    rows = np.unique(np.concatenate(ROW_LISTS))
    for name in ("weight_0", "weight_1", "bias"):
        p_sparse, p_dense = sparse.params[name], dense.params[name]
        np.testing.assert_array_equal(p_sparse.grad_rows, rows)
        assert p_dense.grad_rows is None
        np.testing.assert_allclose(p_sparse.grad[rows], p_dense.grad[rows], rtol=1e-5, atol=1e-7)
        others = np.setdiff1d(np.arange(OUT), rows)
        np.testing.assert_array_equal(p_dense.grad[others], 0)
        np.testing.assert_allclose(p_sparse.dense_grad(lm.CPUBackend()), p_dense.grad, rtol=1e-5, atol=1e-7)


def test_shared_selection_with_a_repeated_column():
    """A column listed twice in a shared selection: both entries scored; its gradient is the sum."""
    net, layer = build()
    net.astype("float64")
    feeds = feeds_for(net, True)
    feeds["sel"] = lm.Selection.shared(np.array([3, 5, 3, 11], np.int32))
    feeds["y"] = np.array([3, 5, 11, 3], np.int32)
    check_gradients(net, feeds)


# ---------------------------------------------------------------- labels and selections

def test_label_positions():
    sel = lm.Selection.from_lists([[4, 7, 4], [7], [2, 9]])
    # a row selecting its label twice uses the first entry
    np.testing.assert_array_equal(sel.label_entries(np.array([4, 7, 9], np.int32)), [0, 3, 5])
    shared = lm.Selection.shared(np.array([8, 2, 8], np.int32))
    np.testing.assert_array_equal(shared.label_entries(np.array([8, 2, 8, 2], np.int32)), [0, 4, 6, 10])
    with pytest.raises(InputError, match="row 1: its label 4 is not among"):
        sel.label_entries(np.array([4, 4, 9], np.int32))


def test_duplicated_label_column_counts_twice_in_the_softmax():
    net, layer = build()
    feeds = feeds_for(net, False)
    feeds["sel"] = lm.Selection.from_lists([[2, 2], [4], [8, 1], [1]])
    out = net.run(feeds)
    z = full_scores(layer, feeds, 1)
    want0 = -(z[0, 2] - np.log(2 * np.exp(z[0, 2])))
    np.testing.assert_allclose(out["loss"][0], want0, rtol=1e-5)
    np.testing.assert_allclose(out["loss"][3], 0, atol=1e-6)  # one entry: probability 1


def test_selection_errors():
    net, _ = build()
    feeds = feeds_for(net, False)
    with pytest.raises(InputError, match="the selection has 4 rows, the input has 3"):
        net.run({**feeds, "x0": feeds["x0"][:3], "y": LABELS[:3]})
    with pytest.raises(InputError, match=r"column ids must lie in \[0, 23\), found 23"):
        net.run({**feeds, "sel": lm.Selection.from_lists([[1], [2], [23], [4]])})
    with pytest.raises(InputError, match="its label 8 is not among"):
        net.run({**feeds, "sel": lm.Selection.from_lists([[2], [4], [5], [1]])})
    with pytest.raises(InputError, match="expected a lamina.Selection"):
        net.run({**feeds, "sel": np.arange(3, dtype=np.int32)})
    with pytest.raises(InputError, match="row 1 is empty"):
        lm.Selection.per_row(np.array([0, 1, 1, 2], np.int32), np.array([1, 2], np.int32))
    with pytest.raises(InputError, match="must be int32"):
        lm.Selection.shared(np.array([1.0, 2.0]))
    with pytest.raises(InputError, match="must end at"):
        lm.Selection.per_row(np.array([0, 1, 3], np.int32), np.array([1, 2], np.int32))
    with pytest.raises(ValueError, match="activation must be one of"):
        SelectiveLinear(3, 4, activation="tanh")
    g = lm.Network()
    x = g.input("x", 3)
    with pytest.raises(GraphError, match="input 1 must be a selection"):
        SelectiveLinear(3, 4)(x, g.input("ids", dtype="int32"))
    with pytest.raises(GraphError, match="must be a selective layer's output"):
        SelectedCrossEntropy()(x, g.input("y", dtype="int32"), g.input("s", dtype="selection"))


def test_top_k():
    scores = np.array([[0.1, 3.0, 2.0, -1.0], [5.0, 4.0, 3.0, 9.0]], np.float32)
    ids, best = lm.top_k(scores, 2)
    np.testing.assert_array_equal(ids, [[1, 2], [3, 0]])
    np.testing.assert_array_equal(best, [[3.0, 2.0], [9.0, 5.0]])
    shared = lm.Selection.shared(np.array([10, 20, 30, 40], np.int32))
    ids, _ = lm.top_k(scores, 3, shared)
    np.testing.assert_array_equal(ids, [[20, 30, 10], [40, 10, 20]])
    per_row = lm.Selection.from_lists([[7, 8, 9], [5]])
    values = lm.Sequences(np.array([1.0, 3.0, 2.0, 4.0], np.float32), per_row.starts(2))
    ids, best = lm.top_k(values, 2, per_row)
    np.testing.assert_array_equal(ids, [[8, 9], [5, -1]])
    assert best[1, 1] == -np.inf


# ---------------------------------------------------------------- optimizers on sparse gradients

@pytest.mark.parametrize("make,exact", [
    (lambda ps: lm.optim.SGD(ps, lr=0.1), True),
    (lambda ps: lm.optim.AdaGrad(ps, lr=0.1), True),
    (lambda ps: lm.optim.SGD(ps, lr=0.1, momentum=0.9, lazy=True), False),
    (lambda ps: lm.optim.Adam(ps, lr=0.01, lazy=True), False),
    (lambda ps: lm.optim.Adam(ps, lr=0.01), True),  # not lazy: a dense update
])
def test_sparse_updates(make, exact):
    """Rows without a gradient never move under the sparse updates; exact optimizers match the
    dense path's update; lazy ones move only the touched rows."""
    nets = {}
    for path in ("sparse", "dense"):
        lm.manual_seed(11)
        net, layer = build(path=path)
        opt = make(net)
        before = layer.weight.value.copy()
        for step in range(3):
            net.train_step(feeds_for(net, False, seed=step), opt)
        nets[path] = (layer, before)
    (sparse, before), (dense, _) = nets["sparse"], nets["dense"]
    rows = np.unique(np.concatenate(ROW_LISTS))
    others = np.setdiff1d(np.arange(OUT), rows)
    if exact:
        np.testing.assert_allclose(sparse.weight.value, dense.weight.value, rtol=1e-5, atol=1e-6)
    else:
        np.testing.assert_array_equal(sparse.weight.value[others], before[others])
        assert not np.allclose(sparse.weight.value[rows], before[rows])


# ---------------------------------------------------------------- sampled softmax

def test_sampled_selection():
    rng = np.random.default_rng(0)
    labels = np.array([3, 0, 3, 99], np.int32)
    for dist in ("uniform", "log_uniform"):
        sel = lm.sampled_selection(labels, 100, 50, dist, rng=rng)
        starts = sel.starts(4)
        np.testing.assert_array_equal(starts, np.arange(5) * 51)
        np.testing.assert_array_equal(sel.columns[starts[:-1]], labels)
        assert sel.columns.min() >= 0 and sel.columns.max() < 100
        neg = sel.columns.reshape(4, 51)[:, 1:]
        hits = neg == labels[:, None]
        assert np.all(np.isinf(sel.logq.reshape(4, 51)[:, 1:][hits]))
        assert np.all(np.isfinite(sel.logq.reshape(4, 51)[:, 1:][~hits]))
    shared = lm.sampled_selection(labels, 100, 20, shared_negatives=True, rng=rng).columns.reshape(4, 21)
    assert (shared[:, 1:] == shared[0, 1:]).all()
    # log-uniform draws follow P(c) = log((c+2)/(c+1)) / log(n+1)
    many = lm.sampled_selection(np.zeros(1, np.int32), 10, 200000, "log_uniform", rng=rng).columns[1:]
    freq = np.bincount(many, minlength=10) / len(many)
    c = np.arange(10)
    np.testing.assert_allclose(freq, np.log((c + 2) / (c + 1)) / np.log(11), atol=5e-3)


def test_sampled_softmax_training_reaches_the_full_softmax_loss():
    """A linear classifier over 400 classes trained with sampled softmax (40 log-uniform
    negatives per row, logQ correction) ends within 0.25 nats of full-softmax training from the
    same start, both measured with the full softmax on held-out data."""
    classes, features = 400, 16
    rng = np.random.default_rng(0)
    centers = rng.standard_normal((classes, features)).astype(np.float32) * 2
    def data(n):
        # Zipf-like class frequencies, as the log-uniform sampler assumes
        y = np.minimum(rng.zipf(1.3, n) - 1, classes - 1).astype(np.int32)
        return (centers[y] + rng.standard_normal((n, features)).astype(np.float32)), y
    test_x, test_y = data(2000)

    def full_loss(layer):
        z = test_x @ layer.weight.value.T + layer.bias.value
        z -= z.max(1, keepdims=True)
        return float(np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(test_y)), test_y]))

    results = {}
    for mode in ("full", "sampled"):
        lm.manual_seed(3)
        net = lm.Network()
        x = net.input("x", features)
        y = net.input("y", dtype="int32")
        layer = SelectiveLinear(features, classes)
        if mode == "full":
            net.outputs(loss=SoftmaxCrossEntropy()(layer(x), y))
        else:
            sel = net.input("sel", dtype="selection")
            scores = layer(x, sel)
            net.outputs(loss=SelectedCrossEntropy()(scores, y, sel))
        opt = lm.optim.Adam(net, lr=0.02)
        batches = np.random.default_rng(1)
        for _ in range(300):
            bx, by = data(128)
            feeds = {"x": bx, "y": by}
            if mode == "sampled":
                feeds["sel"] = lm.sampled_selection(by, classes, 40, "log_uniform", rng=batches)
            net.train_step(feeds, opt)
        results[mode] = full_loss(layer)
    start = np.log(classes)
    assert results["full"] < 0.5 * start
    assert abs(results["sampled"] - results["full"]) < 0.25, results


def test_save_and_load_keeps_the_selection_input(tmp_path):
    net, layer = build()
    feeds = feeds_for(net, False)
    before = net.run(feeds)
    lm.save(net, tmp_path / "sel.lamina")
    again = lm.load(tmp_path / "sel.lamina")
    after = again.run(feeds)
    np.testing.assert_array_equal(after["scores"].values, before["scores"].values)
    np.testing.assert_array_equal(after["loss"], before["loss"])


@pytest.mark.parametrize("distribution", ["uniform", "log_uniform"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_logq_correction_is_log_of_the_expected_count_and_enters_the_cost_subtracted(distribution, shared):
    """logq of every entry (the label's too) is log(num_sampled · Q(class)) for the proposal Q
    of the distribution, exactly; an accidental hit is +inf. The cost is the cross-entropy of
    softmax(z - logq) at the label (entry 0 of each row), computed here in float64 from the
    layer's own scores: a sign flipped in either place fails by orders of magnitude."""
    classes, num_sampled = 30, 12
    labels = np.array([0, 5, 29, 5, 17], np.int32)
    sel = lm.sampled_selection(labels, classes, num_sampled, distribution, shared, rng=np.random.default_rng(4))
    columns = sel.columns.reshape(len(labels), num_sampled + 1)
    c = columns.astype(np.float64)
    q = np.full(c.shape, 1 / classes) if distribution == "uniform" else \
        np.log((c + 2) / (c + 1)) / np.log(classes + 1)
    want = np.log(num_sampled * q)
    hits = np.zeros(columns.shape, bool)
    hits[:, 1:] = columns[:, 1:] == labels[:, None]
    want[hits] = np.inf
    np.testing.assert_array_equal(sel.logq.reshape(columns.shape), want)
    assert (columns[:, 0] == labels).all()

    net = lm.Network()
    x, sel_in, y = net.input("x", 4), net.input("sel", dtype="selection"), net.input("y", dtype="int32")
    scores = SelectiveLinear(4, classes)(x, sel_in)
    net.outputs(loss=SelectedCrossEntropy()(scores, y, sel_in), scores=scores)
    net.astype("float64")
    feeds = {"x": np.random.default_rng(5).standard_normal((len(labels), 4)), "sel": sel, "y": labels}
    out = net.forward(feeds, training=True)
    layer = net.layers[0]
    z = feeds["x"] @ layer.weight.value.T.astype(np.float64) + layer.bias.value
    z = z[np.arange(len(labels))[:, None], columns] - want  # the corrected logits; -inf at hits
    top = z.max(1, keepdims=True)
    expected = -(z[:, 0] - top[:, 0] - np.log(np.exp(z - top).sum(1)))
    np.testing.assert_allclose(np.asarray(out["loss"]).reshape(-1), expected, rtol=1e-12)


@pytest.mark.parametrize("largest", [7, 4096, 1 << 20])
def test_grouping_a_selection_by_column_is_a_stable_sort(largest):
    """Selection.by_column's buckets: each column once, ascending, with its entries in their
    original order (a stable sort), whether the ids sort as 16-bit keys or not."""
    from lamina.selection import group_by_column
    rng = np.random.default_rng(largest)
    lengths = rng.integers(0, 40, 50)
    starts = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    cols = rng.integers(0, largest, starts[-1]).astype(np.int32)
    columns, buckets, entries, entry_rows = group_by_column(starts, cols)
    assert np.all(np.diff(columns) > 0) and set(columns) == set(cols)
    row_of = np.repeat(np.arange(50), lengths)
    for j, c in enumerate(columns):
        mine = entries[buckets[j]:buckets[j + 1]]
        np.testing.assert_array_equal(mine, np.flatnonzero(cols == c))
        np.testing.assert_array_equal(entry_rows[buckets[j]:buckets[j + 1]], row_of[mine])
    assert buckets[-1] == len(cols) and all(a.dtype == np.int32 for a in (columns, buckets, entries, entry_rows))
