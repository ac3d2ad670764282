"""Kernel conformance: every kernel of every backend against the plain numpy reference, in both
float types, at sizes that are not multiples of anything (1, 7, 33, 129), with beta 0 on outputs
full of NaN (beta 0 must never read them) and beta 1 on finite outputs."""
import numpy as np
import pytest

from lamina.backends.base import ALL_ACTIVATIONS, INPUT_GRAD_ACTIVATIONS
from lamina.backends.cpu import CPUBackend
from lamina.backends.cpu.backend import GEMM_SPLIT_MIN
from lamina.backends.reference import ReferenceBackend

REF = ReferenceBackend()
DTYPES = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}
SIZES = [(1, 1, 1), (7, 33, 1), (33, 7, 129), (129, 33, 7), (64, 130, 96)]
# products large enough that the CPU splits them between threads, by rows and by columns
SPLIT_SIZES = [(257, 33, 300), (33, 301, 257)]


from conftest import BLAS_PROVIDERS, stable_rng as rng_for


def out_pair(shape, dtype, beta, rng):
    """The same starting output for backend and reference: NaN for beta 0, data for beta 1."""
    start = np.full(shape, np.nan, dtype) if beta == 0 else rng.standard_normal(shape).astype(dtype)
    return start.copy(), start.copy()


def close(a, b, dtype):
    np.testing.assert_allclose(a, b, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SIZES + SPLIT_SIZES)
@pytest.mark.parametrize("trans_a", [False, True])
@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_gemm(backend, dtype, m, n, k, trans_a, trans_b, beta):
    rng = rng_for(m, n, k, trans_a, trans_b)
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    c, c_ref = out_pair((m, n), dtype, beta, rng)
    backend.gemm(a, b, c, trans_a, trans_b, alpha=0.75, beta=beta)
    REF.gemm(a.astype(np.float64), b.astype(np.float64), c_ref, trans_a, trans_b, alpha=0.75, beta=beta)
    close(c, c_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", SIZES + SPLIT_SIZES)
@pytest.mark.parametrize("trans_b", [False, True])
def test_gemm_bias(backend, dtype, m, n, k, trans_b):
    """A Linear's forward: every row of c gets the bias; c starts as NaN (never read)."""
    rng = rng_for("gemm bias", m, n, k, trans_b)
    a = rng.standard_normal((m, k)).astype(dtype)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    c = np.full((m, n), np.nan, dtype)
    backend.gemm_bias(a, b, c, bias, trans_b=trans_b)
    close(c, a.astype(np.float64) @ (b.T if trans_b else b).astype(np.float64) + bias, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 7, 8, 64])
@pytest.mark.parametrize("n", [17, 40])
def test_packed_gemm(backend, dtype, trans, rows, n):
    # n: whole and partial panels (16 floats or 8 doubles wide); rows: whole and partial tiles of 6,
    # and the narrow tiles of 1 and 2 rows; k odd: the narrow tile's last single kk
    rng = rng_for("pack", trans, rows, n)
    k = 33
    b = rng.standard_normal((n, k) if trans else (k, n)).astype(dtype)
    packed = backend.pack(b, trans=trans, alpha=1.5, max_rows=64)
    for beta in (0.0, 1.0, 0.5):
        a = rng.standard_normal((rows, k)).astype(dtype)
        c, c_ref = out_pair((rows, n), dtype, beta, rng)
        backend.packed_gemm(a, packed, c, beta)
        REF.packed_gemm(a, REF.pack(b, trans, 1.5), c_ref, beta)
        close(c, c_ref, dtype)


@pytest.mark.parametrize("provider", BLAS_PROVIDERS)
@pytest.mark.parametrize("rows", [64, 200])
def test_packed_gemm_recurrent_shape(provider, rows):
    """The recurrent step's shape, big enough that the panels are split between threads; 200
    rows of 512 floats are 3 blocks of 64 rows (panels.h's 128 KB) and a last block of 8."""
    be = CPUBackend(provider)
    rng = rng_for("pack-big", provider, rows)
    w = rng.standard_normal((2048, 512)).astype(np.float32)
    a = rng.standard_normal((rows, 512)).astype(np.float32)
    c = rng.standard_normal((rows, 2048)).astype(np.float32)
    expect = a.astype(np.float64) @ w.T.astype(np.float64) + c
    be.packed_gemm(a, be.pack(w, trans=True, max_rows=rows), c, beta=1.0)
    np.testing.assert_allclose(c, expect, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("provider", BLAS_PROVIDERS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,k,n", [(800, 64, 48), (100, 300, 70), (5, 300, 1500), (3, 4, 5)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_packed_gemm_split_between_threads(provider, dtype, rows, k, n, threads):
    """A large panel product splits by blocks of rows (800 rows) or by runs of panels (100 and 5
    rows; each thread writes only its columns, 70 of them a partial last panel); 3 x 4 x 5 runs on
    one thread. With and without a bias, beta 0 on NaN outputs, and beta 1."""
    import lamina as lm
    be = CPUBackend(provider)
    rng = rng_for("pack-split", provider, rows, threads)
    w = rng.standard_normal((n, k)).astype(dtype)
    a = rng.standard_normal((rows, k)).astype(dtype)
    bias = rng.standard_normal(n).astype(dtype)
    product = a.astype(np.float64) @ w.T.astype(np.float64)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == np.float32 else TOL[np.float64]  # (sums of 300)
    before = lm.get_num_threads()
    try:
        lm.set_num_threads(threads)
        packed = be.pack(w, trans=True, max_rows=rows)
        for beta in (0.0, 1.0):
            c, start = out_pair((rows, n), dtype, beta, rng)
            be.packed_gemm(a, packed, c, beta)
            np.testing.assert_allclose(c, product + (start if beta else 0), **tol)
        c = np.full((rows, n), np.nan, dtype)
        be.packed_gemm_bias(a, packed, c, bias)
        np.testing.assert_allclose(c, product + bias, **tol)
    finally:
        lm.set_num_threads(before)


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_gemm_over_runs_of_panels_and_blocks_of_rows(dtype):
    """A deep product: panels.h takes rows in blocks (16 floats' or 8 doubles' rows of 2048) and
    panels in runs (2 of them), every block over one run before the next; 40 rows x 7 panels are
    several of each, the last of each partial; panels 1 .. 6 only touch their own columns."""
    from lamina.backends.cpu import _kernels
    rng = rng_for("panel runs", dtype)
    m, k, n = 40, 2048, 100
    a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
    packed = np.empty(_kernels.panel_size(b, False), dtype)
    _kernels.panel_pack(b, False, 1.0, packed)
    c = np.full((m, n), np.nan, dtype)
    _kernels.panel_gemm(a, packed, n, c, 0.0)
    tol = {"rtol": 1e-4, "atol": 1e-3} if dtype == np.float32 else TOL[np.float64]  # (sums of 2048)
    np.testing.assert_allclose(c, a.astype(np.float64) @ b, **tol)
    width = 64 // np.dtype(dtype).itemsize
    part = np.full((m, n), 7.0, dtype)
    _kernels.panel_gemm(a, packed, n, part, 0.0, 1, 6)
    inside = slice(width, 6 * width)
    np.testing.assert_allclose(part[:, inside], c[:, inside], **tol)
    assert (np.delete(part, np.r_[inside], axis=1) == 7).all()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("by_rows", [False, True])
def test_panel_gemm_on_a_team(dtype, threads, by_rows):
    """A team of threads shares the product by runs of panels or by blocks of row tiles (members
    without a share included: 3 threads, 8 rows); the result is the one-thread product, with or
    without a bias, and columns outside panels p0 .. p1 stay untouched."""
    from lamina.backends.cpu import _kernels
    rng = rng_for("panel team", dtype, threads, by_rows)
    k, n = 37, 70
    b = rng.standard_normal((k, n)).astype(dtype)
    packed = np.empty(_kernels.panel_size(b, False), dtype)
    _kernels.panel_pack(b, False, 1.0, packed)
    bias = rng.standard_normal(n).astype(dtype)
    width = 64 // np.dtype(dtype).itemsize
    for m in (8, 45):
        a = rng.standard_normal((m, k)).astype(dtype)
        one, team = np.full((m, n), 2.0, dtype), np.full((m, n), 2.0, dtype)
        _kernels.panel_gemm(a, packed, n, one, 0.5)
        _kernels.panel_gemm(a, packed, n, team, 0.5, threads=threads, by_rows=by_rows)
        np.testing.assert_array_equal(team, one)
        np.testing.assert_allclose(one, 1.0 + a.astype(np.float64) @ b, **TOL[dtype])
        with_bias = np.full((m, n), np.nan, dtype)
        _kernels.panel_gemm(a, packed, n, with_bias, 0.0, 1, 4, threads=threads, by_rows=by_rows, bias=bias)
        inside = slice(width, min(n, 4 * width))
        np.testing.assert_allclose(with_bias[:, inside], (bias + a.astype(np.float64) @ b)[:, inside], **TOL[dtype])
        assert np.isnan(np.delete(with_bias, np.r_[inside], axis=1)).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_panel_gemm_at_every_row_count(dtype):
    """Rows 1 .. 19: every remainder of a row tile (8 rows on 64-byte vectors in the AVX-512 build,
    6 elsewhere) and every smaller tile it leaves to (6, 4, 2, 1 rows), with beta and with a bias;
    a partial last panel."""
    from lamina.backends.cpu import _kernels
    rng = rng_for("panel rows", dtype)
    k, n = 37, 40
    b = rng.standard_normal((k, n)).astype(dtype)
    packed = np.empty(_kernels.panel_size(b, False), dtype)
    _kernels.panel_pack(b, False, 1.0, packed)
    bias = rng.standard_normal(n).astype(dtype)
    for m in range(1, 20):
        a = rng.standard_normal((m, k)).astype(dtype)
        product = a.astype(np.float64) @ b
        c = np.full((m, n), 2.0, dtype)
        _kernels.panel_gemm(a, packed, n, c, 0.5)
        np.testing.assert_allclose(c, 1.0 + product, **TOL[dtype], err_msg=f"{m} rows")
        c = np.full((m, n), np.nan, dtype)
        _kernels.panel_gemm(a, packed, n, c, 0.0, bias=bias)
        np.testing.assert_allclose(c, bias + product, **TOL[dtype], err_msg=f"{m} rows, bias")


def test_panel_gemm_checks_its_arguments():
    from lamina.backends.cpu import _kernels
    a, c = np.ones((4, 3), np.float32), np.zeros((4, 20), np.float32)
    packed = np.ones(_kernels.panel_count(20, 4) * 3 * 16, np.float32)
    _kernels.panel_gemm(a, packed, 20, c, 0.0)
    assert (c == 3).all()
    with pytest.raises(ValueError, match="panels of a 3 x 20 matrix take 96 values, found 95"):
        _kernels.panel_gemm(a, packed[:-1], 20, c, 0.0)
    with pytest.raises(ValueError, match="c must be 4 x 20, found 4 x 19"):
        _kernels.panel_gemm(a, packed, 20, c[:, :19].copy(), 0.0)
    with pytest.raises(ValueError, match=r"panels 1 \.\. 3 out of 0 \.\. 2"):
        _kernels.panel_gemm(a, packed, 20, c, 0.0, 1, 3)
    with pytest.raises(ValueError, match="threads must be at least 1, found 0"):
        _kernels.panel_gemm(a, packed, 20, c, 0.0, threads=0)
    with pytest.raises(ValueError, match=r"bias must hold 20 values \(one per column\), found 19"):
        _kernels.panel_gemm(a, packed, 20, c, 0.0, bias=np.ones(19, np.float32))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,cols", [(1, 1), (7, 33), (129, 300)])
def test_bias(backend, dtype, rows, cols):
    rng = rng_for("bias", rows, cols)
    y = rng.standard_normal((rows, cols)).astype(dtype)
    b = rng.standard_normal(cols).astype(dtype)
    y_ref = y.copy()
    backend.add_bias(y, b)
    REF.add_bias(y_ref, b)
    close(y, y_ref, dtype)
    for beta in (0.0, 1.0):
        db, db_ref = out_pair((cols,), dtype, beta, rng)
        backend.bias_grad(y, db, beta)
        REF.bias_grad(y, db_ref, beta)
        close(db, db_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ALL_ACTIVATIONS)
@pytest.mark.parametrize("shape", [(1, 1), (7, 33), (129, 7), (300, 257), (3, 4, 5), (2, 3, 1, 7)])
def test_activation(backend, dtype, kind, shape):
    """Several axes per sample: softmax normalises along the last one on every backend."""
    rng = rng_for("act", kind, shape)
    x = (2 * rng.standard_normal(shape)).astype(dtype)
    y, y_ref = np.empty_like(x), np.empty_like(x)
    backend.activation(kind, x, y, slope=0.1)
    REF.activation(kind, x, y_ref, slope=0.1)
    close(y, y_ref, dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    for beta in (0.0, 1.0):
        dx, dx_ref = out_pair(shape, dtype, beta, rng)
        z = x if kind in INPUT_GRAD_ACTIVATIONS else y  # what the derivative is computed from
        backend.activation_backward(kind, z, dy, dx, beta, slope=0.1)
        REF.activation_backward(kind, z, dy, dx_ref, beta, slope=0.1)
        close(dx, dx_ref, dtype)


@pytest.mark.parametrize("kind", ALL_ACTIVATIONS)
def test_activations_propagate_nan(backend, kind):
    """NaN in, NaN out (as in PyTorch): an activation never hides a NaN as a finite value."""
    x = np.array([[np.nan, 2.0 if kind in ("sqrt", "log") else -1.0, 0.5]])
    y = np.zeros_like(x)
    backend.activation(kind, x, y)
    assert np.isnan(y[0, 0])
    if kind not in ("softmax", "log_softmax"):
        np.testing.assert_array_equal(np.isnan(y), [[True, False, False]])


def test_activation_in_place(backend):
    x = np.linspace(-3, 3, 77).reshape(7, 11)
    expected = np.tanh(x)
    backend.activation("tanh", x, x)
    np.testing.assert_allclose(x, expected, rtol=1e-14)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [1, 7, 129, 100003])
def test_elementwise(backend, dtype, n):
    rng = rng_for("elementwise", n)
    x, z = rng.standard_normal(n).astype(dtype), rng.standard_normal(n).astype(dtype)
    for beta in (0.0, 1.0):
        y, y_ref = out_pair((n,), dtype, beta, rng)
        backend.axpby(-0.5, x, beta, y)
        REF.axpby(-0.5, x, beta, y_ref)
        close(y, y_ref, dtype)
        o, o_ref = out_pair((n,), dtype, beta, rng)
        backend.multiply(x, z, o, beta)
        REF.multiply(x, z, o_ref, beta)
        close(o, o_ref, dtype)
    np.testing.assert_allclose(backend.sum_squares(x), REF.sum_squares(x), rtol=1e-6 if dtype == np.float32 else 1e-12)
    if n > 1:  # of listed rows only, x seen as [rows, 7] where it divides
        x2 = x[:n - n % 7].reshape(-1, 7) if n >= 7 else x.reshape(n, 1)
        rows = np.arange(0, len(x2), 2, dtype=np.int32)
        np.testing.assert_allclose(backend.sum_squares(np.ascontiguousarray(x2), rows), REF.sum_squares(x2, rows),
                                   rtol=1e-6 if dtype == np.float32 else 1e-12)


@pytest.mark.parametrize("dtype", DTYPES)
def test_columns(backend, dtype):
    rng = rng_for("columns")
    src = rng.standard_normal((9, 5)).astype(dtype)
    for beta in (0.0, 1.0):
        big, big_ref = out_pair((9, 13), dtype, 1.0, rng)
        backend.copy_to_columns(src, big, 4, beta)
        REF.copy_to_columns(src, big_ref, 4, beta)
        close(big, big_ref, dtype)
        small, small_ref = out_pair((9, 5), dtype, beta, rng)
        backend.copy_from_columns(big, 8, small, beta)
        REF.copy_from_columns(big, 8, small_ref, beta)
        close(small, small_ref, dtype)


def test_bernoulli_mask(backend):
    mask = np.empty((400, 250), np.float32)
    backend.bernoulli_mask(mask, 0.8, np.random.default_rng(0))
    values = set(np.unique(mask).tolist())
    assert values == {0.0, np.float32(1 / 0.8)}
    assert abs((mask > 0).mean() - 0.8) < 0.01  # 100k draws: 4 standard deviations is 0.005


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("rows,classes", [(1, 1), (7, 33), (129, 5)])
def test_softmax_cross_entropy(backend, dtype, weighted, rows, classes):
    rng = rng_for("sce", weighted, rows, classes)
    x = (3 * rng.standard_normal((rows, classes))).astype(dtype)
    labels = rng.integers(0, classes, rows).astype(np.int32)
    w = rng.uniform(0.5, 2, rows).astype(dtype) if weighted else None
    probs, probs_ref = np.empty_like(x), np.empty_like(x)
    cost, cost_ref = np.empty(rows, dtype), np.empty(rows, dtype)
    backend.softmax_cross_entropy(x, labels, w, probs, cost)
    REF.softmax_cross_entropy(x, labels, w, probs_ref, cost_ref)
    close(probs, probs_ref, dtype)
    close(cost, cost_ref, dtype)
    alone = np.full(rows, np.nan, dtype)  # no probabilities wanted (inference): the same costs
    backend.softmax_cross_entropy(x, labels, w, None, alone)
    close(alone, cost_ref, dtype)
    dcost = rng.standard_normal(rows).astype(dtype)
    for beta in (0.0, 1.0):
        dx, dx_ref = out_pair(x.shape, dtype, beta, rng)
        backend.softmax_cross_entropy_backward(probs, labels, w, dcost, dx, beta)
        REF.softmax_cross_entropy_backward(probs, labels, w, dcost, dx_ref, beta)
        close(dx, dx_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax_rows_over_the_whole_range(backend, dtype):
    """Rows spanning hundreds of units (float32 rows run a polynomial exp): every probability
    in float32's normal range is within 1e-6 of float64's, relatively, plus the rounding of
    x - max in float32 (half an ulp of it, which e^(x - max) turns into a relative error); a label whose
    probability underflows still costs its exact, finite -log p (log-sum-exp minus its logit);
    4099 columns run the tail after the vectorised lanes; equal values give a uniform row."""
    rng = rng_for("softmax range", dtype)
    x = (40 * rng.standard_normal((6, 4099))).astype(dtype)
    x[5] = 1.5
    exact = x.astype(np.float64) - x.max(1, keepdims=True)
    lse = np.log(np.exp(exact).sum(1))
    probs, log_probs = np.empty_like(x), np.empty_like(x)
    backend.activation("softmax", x, probs)
    backend.activation("log_softmax", x, log_probs)
    want = np.exp(exact - lse[:, None])
    seen = want > 1e-37
    bound = 1e-6 + np.spacing(np.abs(exact).astype(np.float32)) / 2 if dtype == np.float32 else 1e-12
    assert np.all((np.abs(probs - want) / want <= bound)[seen])
    np.testing.assert_allclose(log_probs, exact - lse[:, None], rtol=1e-6 if dtype == np.float32 else 1e-12, atol=1e-5)
    np.testing.assert_allclose(probs[5], 1 / 4099, rtol=1e-6)
    labels = np.argmin(x, 1).astype(np.int32)  # probabilities far below float32's smallest
    cost = np.empty(len(x), dtype)
    backend.softmax_cross_entropy(x, labels, None, np.empty_like(x), cost)
    assert np.all(np.isfinite(cost))
    np.testing.assert_allclose(cost, lse - exact[np.arange(len(x)), labels], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cost", ["square_error", "bce_with_logits"])
@pytest.mark.parametrize("weighted", [False, True])
def test_pair_costs(backend, dtype, cost, weighted):
    rng = rng_for(cost, weighted)
    x = (2 * rng.standard_normal((33, 7))).astype(dtype)
    t = rng.uniform(0, 1, (33, 7)).astype(dtype)
    w = rng.uniform(0.5, 2, 33).astype(dtype) if weighted else None
    c, c_ref = np.empty(33, dtype), np.empty(33, dtype)
    getattr(backend, cost)(x, t, w, c)
    getattr(REF, cost)(x, t, w, c_ref)
    close(c, c_ref, dtype)
    dcost = rng.standard_normal(33).astype(dtype)
    for wrt_target in (False, True):
        for beta in (0.0, 1.0):
            d, d_ref = out_pair(x.shape, dtype, beta, rng)
            getattr(backend, cost + "_backward")(x, t, w, dcost, d, wrt_target, beta)
            getattr(REF, cost + "_backward")(x, t, w, dcost, d_ref, wrt_target, beta)
            close(d, d_ref, dtype)


OPTIMIZERS = {
    "sgd": (lambda be, p, g, s: be.sgd_update(p, g, None, 0.1, 0.0, 0.0, False, 0.01), 0),
    "sgd_momentum": (lambda be, p, g, s: be.sgd_update(p, g, s[0], 0.1, 0.9, 0.1, False, 0.01), 1),
    "sgd_nesterov": (lambda be, p, g, s: be.sgd_update(p, g, s[0], 0.1, 0.9, 0.0, True, 0.0), 1),
    "adam": (lambda be, p, g, s: be.adam_update(p, g, s[0], s[1], 0.01, 0.9, 0.999, 1e-8, 0.01, False, 3), 2),
    "adamw": (lambda be, p, g, s: be.adam_update(p, g, s[0], s[1], 0.01, 0.8, 0.99, 1e-8, 0.1, True, 1), 2),
    "adagrad": (lambda be, p, g, s: be.adagrad_update(p, g, s[0], 0.1, 1e-10, 0.01), 1),
    "rmsprop": (lambda be, p, g, s: be.rmsprop_update(p, g, s[0], None, 0.01, 0.99, 1e-8, 0.0, 0.0), 1),
    "rmsprop_momentum": (lambda be, p, g, s: be.rmsprop_update(p, g, s[0], s[1], 0.01, 0.9, 1e-8, 0.01, 0.5), 2),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("n", [1, 129, 40000])
def test_optimizer_updates(backend, dtype, name, n):
    update, n_state = OPTIMIZERS[name]
    rng = rng_for(name, n)
    p = rng.standard_normal(n).astype(dtype)
    state = [np.abs(rng.standard_normal(n)).astype(dtype) for _ in range(n_state)]
    p_ref, state_ref = p.copy(), [s.copy() for s in state]
    for step in range(3):
        g = rng.standard_normal(n).astype(dtype)
        update(backend, p, g, state)
        update(REF, p_ref, g, state_ref)
    close(p, p_ref, dtype)
    for s, s_ref in zip(state, state_ref):
        close(s, s_ref, dtype)


# ---------------------------------------------------------------- boundary checks

def cpu_only(backend, why="the numpy-boundary argument checks of the CPU backend"):
    if backend.name != "cpu":
        pytest.skip(why)


def test_gemm_rejects_bad_arguments(backend):
    cpu_only(backend)
    a = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match=r"gemm: op\(a\) is 4x3 and op\(b\) is 5x2"):
        backend.gemm(a, np.zeros((5, 2), np.float32), np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="gemm: b must be float32, found float64"):
        backend.gemm(a, np.zeros((3, 2)), np.zeros((4, 2), np.float32))
    with pytest.raises(ValueError, match="gemm: b must have contiguous rows"):
        backend.gemm(a, np.zeros((2, 3), np.float32).T, np.zeros((4, 2), np.float32))
    with pytest.raises(TypeError, match="gemm: a must be a numpy array, found list"):
        backend.gemm([[1.0]], a, a)


def test_kernels_reject_mismatches(backend):
    cpu_only(backend)
    x = np.zeros((4, 3), np.float32)
    with pytest.raises(ValueError, match="activation: y must have shape \\(4, 3\\), found \\(3, 4\\)"):
        backend.activation("relu", x, np.zeros((3, 4), np.float32))
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        backend.activation("swish", x, x)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\), found 3"):
        backend.softmax_cross_entropy(x, np.array([0, 1, 2, 3], np.int32), None, x.copy(), np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="labels must be int32, found int64"):
        backend.softmax_cross_entropy(x, np.zeros(4, np.int64), None, x.copy(), np.zeros(4, np.float32))
    with pytest.raises(ValueError, match="packed_gemm: a must have 3 columns"):
        backend.packed_gemm(np.zeros((2, 4), np.float32), backend.pack(x[:3], max_rows=4), np.zeros((2, 3), np.float32))


def test_kernels_release_the_gil(backend):
    """While one long GEMM runs, a Python thread keeps running: its longest pause stays far below
    the kernel's duration. Were the GIL held, it would stall for the whole kernel. (CPU backends:
    an OpenCL CPU device takes every core, so the watching thread could stall for that reason.)"""
    cpu_only(backend, "the CPU backend's own threads (an OpenCL CPU device takes every core)")
    import threading
    import time

    import lamina as lm
    threads = lm.get_num_threads()
    lm.set_num_threads(1)  # the kernel on one core, the Python thread on the other
    try:
        a = np.ones((2000, 2000), np.float32)
        c = np.empty_like(a)
        running, longest = threading.Event(), [0.0]

        def watch():
            last = time.perf_counter()
            running.set()
            while running.is_set():
                now = time.perf_counter()
                longest[0] = max(longest[0], now - last)
                last = now

        t = threading.Thread(target=watch)
        t.start()
        running.wait()
        start = time.perf_counter()
        backend.gemm(a, a, c)
        duration = time.perf_counter() - start
        running.clear()
        t.join()
    finally:
        lm.set_num_threads(threads)
    assert longest[0] < duration / 2, (longest[0], duration)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_prev", [False, True])
@pytest.mark.parametrize("rows,H", [(1, 1), (7, 33), (64, 129)])
def test_lstm_step(backend, dtype, has_prev, rows, H):
    rng = rng_for("lstm", has_prev, rows, H)
    g = (2 * rng.standard_normal((rows, 4 * H))).astype(dtype)
    c_prev = rng.standard_normal((rows, H)).astype(dtype) if has_prev else None
    outs = {}
    for be in (backend, REF):
        gg, c, h = g.copy(), np.full((rows, H), np.nan, dtype), np.full((rows, H), np.nan, dtype)
        be.lstm_step(gg, c_prev, c, h)
        dh, dc = rng_for("d", rows).standard_normal((2, rows, H)).astype(dtype)
        dg = np.full((rows, 4 * H), np.nan, dtype)
        dc_prev = np.ones((rows, H), dtype) if has_prev else None
        be.lstm_step_backward(gg, c_prev, c, dh, dc, dg, dc_prev)
        outs[be.name] = (gg, c, h, dg, dc_prev)
    for a, b in zip(outs[backend.name], outs["reference"]):
        if a is not None:
            close(a, b, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("has_prev", [False, True])
@pytest.mark.parametrize("rows,H", [(1, 1), (7, 33), (64, 129)])
def test_gru_step(backend, dtype, has_prev, rows, H):
    rng = rng_for("gru", has_prev, rows, H)
    g = (2 * rng.standard_normal((rows, 3 * H))).astype(dtype)
    hh = rng.standard_normal((rows, 3 * H)).astype(dtype)
    h_prev = rng.standard_normal((rows, H)).astype(dtype) if has_prev else None
    outs = {}
    for be in (backend, REF):
        gg, h = g.copy(), np.full((rows, H), np.nan, dtype)
        be.gru_step(gg, hh, h_prev, h)
        dh = rng_for("dh", rows).standard_normal((rows, H)).astype(dtype)
        dgx, dgh = np.full((2, rows, 3 * H), np.nan, dtype)
        dh_prev = np.ones((rows, H), dtype) if has_prev else None
        be.gru_step_backward(gg, hh, h_prev, dh, dgx, dgh, dh_prev)
        outs[be.name] = (gg, h, dgx, dgh, dh_prev)
    for a, b in zip(outs[backend.name], outs["reference"]):
        if a is not None:
            close(a, b, dtype)


STARTS = np.array([0, 3, 4, 8, 10], np.int32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["last", "first", "average", "sum", "max"])
def test_sequence_pool_kernels(backend, dtype, mode):
    rng = rng_for("pool", mode)
    x = rng.standard_normal((10, 5)).astype(dtype)
    out, out_ref = np.full((2, 4, 5), np.nan, dtype)
    arg, arg_ref = np.zeros((2, 4, 5), np.int32)
    backend.sequence_pool(mode, x, STARTS, out, arg)
    REF.sequence_pool(mode, x, STARTS, out_ref, arg_ref)
    close(out, out_ref, dtype)
    dy = rng.standard_normal((4, 5)).astype(dtype)
    for beta in (0.0, 1.0):
        dx, dx_ref = out_pair((10, 5), dtype, beta, rng)
        backend.sequence_pool_backward(mode, dy, STARTS, arg, dx, beta)
        REF.sequence_pool_backward(mode, dy, STARTS, arg_ref, dx_ref, beta)
        close(dx, dx_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sequence_softmax_kernels(backend, dtype):
    rng = rng_for("seqsoftmax")
    x = (3 * rng.standard_normal(10)).astype(dtype)
    y, y_ref = np.empty_like(x), np.empty_like(x)
    backend.sequence_softmax(x, STARTS, y)
    REF.sequence_softmax(x, STARTS, y_ref)
    close(y, y_ref, dtype)
    dy = rng.standard_normal(10).astype(dtype)
    for beta in (0.0, 1.0):
        dx, dx_ref = out_pair((10,), dtype, beta, rng)
        backend.sequence_softmax_backward(y, dy, STARTS, dx, beta)
        REF.sequence_softmax_backward(y, dy, STARTS, dx_ref, beta)
        close(dx, dx_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_sparse_row_kernels(backend, dtype):
    rng = rng_for("rows")
    ids = np.array([3, 0, 3, 5, 0, 0], np.int32)  # repeats add up
    src = rng.standard_normal((6, 600)).astype(dtype)
    dst = rng.standard_normal((7, 600)).astype(dtype)
    dst_ref = dst.copy()
    backend.scatter_add_rows(src, ids, dst)
    REF.scatter_add_rows(src, ids, dst_ref)
    close(dst, dst_ref, dtype)
    rows = np.array([1, 4], np.int32)
    backend.fill_rows(dst, rows, 0.0)
    REF.fill_rows(dst_ref, rows, 0.0)
    close(dst, dst_ref, dtype)

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(7, 600), (7,)])
def test_row_updates(backend, dtype, shape):
    """Optimizer updates of listed rows (2-D weights and 1-D biases) against the reference; the
    other rows and their state stay exactly as they were."""
    rng = rng_for("row updates", shape)
    rows = np.array([1, 4, 5], np.int32)
    p, g, s, m, v = rng.standard_normal((5,) + shape).astype(dtype)
    s, v = np.abs(s), np.abs(v)
    runs = []
    for be in (backend, REF):
        arrays = [a.copy() for a in (p, s, m, v)]
        pp, ss, mm, vv = arrays
        be.sgd_update_rows(pp, g, None, rows, 0.1)
        be.sgd_update_rows(pp, g, mm, rows, 0.1, momentum=0.9, dampening=0.1)
        be.sgd_update_rows(pp, g, mm, rows, 0.1, momentum=0.9, nesterov=True)
        be.adagrad_update_rows(pp, g, ss, rows, 0.1, 1e-10)
        be.adam_update_rows(pp, g, mm, vv, rows, 0.01, 0.9, 0.999, 1e-8, 3)
        runs.append(arrays)
    untouched = np.setdiff1d(np.arange(shape[0]), rows)
    for got, want, start in zip(runs[0], runs[1], (p, s, m, v)):
        close(got, want, dtype)
        np.testing.assert_array_equal(got[untouched], start[untouched])


def test_fast_tanh_accuracy():
    """The float32 tanh of the recurrent cells stays within 5e-7 of the true tanh everywhere."""
    from lamina.backends.cpu import _kernels
    x = np.linspace(-20, 20, 400001).astype(np.float32)
    y = np.empty_like(x)
    _kernels.fast_tanh(x, y)
    assert np.abs(y - np.tanh(x.astype(np.float64))).max() < 5e-7


@pytest.mark.parametrize("dtype", DTYPES)
def test_gemm_on_column_blocks(backend, dtype):
    """Blocks of columns of larger matrices (strided rows) work as GEMM operands and outputs."""
    rng = rng_for("blocks")
    big_a = rng.standard_normal((7, 20)).astype(dtype)
    big_b = rng.standard_normal((9, 30)).astype(dtype)
    big_c = rng.standard_normal((7, 40)).astype(dtype)
    a, b, c = big_a[:, 3:12], big_b[:, 5:16], big_c[:, 10:21]
    expected = big_c.copy()
    expected[:, 10:21] = 2 * a @ b + c
    backend.gemm(a, b, c, alpha=2.0, beta=1.0)
    close(big_c, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("geometry,shape", [
    (((2, 3, 2), (1, 2, 1), (0, 1, 1), (1, 1, 2)), (2, 4, 5, 6)),
    (((3, 3, 3), (2, 2, 3), (1, 1, 1), (1, 2, 1)), (3, 5, 6, 7)),
    (((1, 2, 2), (1, 1, 1), (0, 0, 0), (1, 1, 1)), (2, 1, 4, 3)),
    # rows long enough for the vector paths (strides 1 and 2) and their tails
    (((2, 2, 3), (1, 2, 2), (1, 0, 1), (1, 1, 1)), (2, 3, 4, 45)),
    (((1, 1, 4), (1, 1, 1), (0, 0, 2), (1, 1, 2)), (1, 1, 4, 40)),
    # kernel 3, stride 2, padding 1 (a transposed convolution's output rows of 32 and 33): col2vol's
    # last vector of a row with its lanes already added, and moved back a place at the row's end
    (((1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1)), (2, 2, 5, 32)),
    (((1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1)), (2, 2, 5, 33)),
    # width stride 2 adds a window row's taps at once: kernel 4 (a tap reading before the row's
    # start), more window rows than one walk chunk, a row of outputs past the last whole block
    (((1, 4, 4), (1, 2, 2), (0, 1, 1), (1, 1, 1)), (1, 2, 37, 34)),
    (((2, 2, 3), (1, 1, 2), (0, 0, 2), (1, 1, 2)), (2, 3, 3, 21)),
    # fewer window columns than a vector: the taps' lanes gathered one by one
    (((1, 1, 9), (1, 1, 2), (0, 0, 0), (1, 1, 1)), (1, 1, 4, 16)),
])
@pytest.mark.parametrize("block", [None, (1, 3)])
def test_vol2col_and_col2vol(backend, dtype, geometry, shape, block):
    kernel, stride, padding, dilation = geometry
    grid = tuple((n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in zip(shape[1:], kernel, stride, padding, dilation))
    geo = (kernel, stride, padding, dilation, grid)
    rng = rng_for("vol", shape, block)
    x = rng.standard_normal(shape).astype(dtype)
    r0, r1 = block if block is not None else (0, grid[0] * grid[1])
    cols = (r1 - r0) * grid[2]
    col, col_ref = np.full((2, shape[0] * int(np.prod(kernel)), cols), np.nan, dtype)
    backend.vol2col(x, col, geo, block)
    REF.vol2col(x, col_ref, geo, block)
    close(col, col_ref, dtype)
    v, v_ref = rng.standard_normal((2,) + shape).astype(dtype)
    v_ref[...] = v
    backend.col2vol(col, v, geo, block)
    REF.col2vol(col_ref, v_ref, geo, block)
    close(v, v_ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("beta", [0.0, 1.0, -0.5])
def test_channel_bias(backend, dtype, beta):
    """y[n, c, ...] = beta·y + b[c] over 2-D and 3-D maps; beta 0 overwrites a NaN-filled y."""
    rng = rng_for("channel bias", beta)
    for shape in ((2, 3, 5, 7), (1, 4, 2, 3, 17)):
        b = rng.standard_normal(shape[1]).astype(dtype)
        y = np.full(shape, np.nan, dtype) if beta == 0 else rng.standard_normal(shape).astype(dtype)
        expected = b.reshape((1, -1) + (1,) * (len(shape) - 2)) + (np.zeros(shape, dtype) if beta == 0 else beta * y)
        ref = y.copy()
        REF.channel_bias(ref, b, beta)
        backend.channel_bias(y, b, beta)
        close(y, expected, dtype)
        close(ref, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spatial", [1, 15, 16, 17, 129])
def test_channel_reductions(backend, dtype, spatial):
    """The per-channel sums (bias gradient, batch-norm statistics) around the kernels' vector
    widths, on data with a large common offset (a one-pass variance would lose it)."""
    rng = rng_for("channels", spatial)
    x = (1000 + rng.standard_normal((3, 5, spatial))).astype(dtype)
    for beta in (0.0, 1.0):
        db, db_ref = out_pair((5,), dtype, beta, rng)
        backend.channel_bias_grad(x, db, beta)
        REF.channel_bias_grad(x, db_ref, beta)
        np.testing.assert_allclose(db, db_ref, rtol=1e-6 if dtype == np.float32 else 1e-12)
    stat = backend.stat_dtype(np.dtype(dtype))  # float64 on the CPU; the data's type on OpenCL
    mean, var = np.empty(5, stat), np.empty(5, stat)
    backend.batch_norm_stats(x, mean, var)
    x64 = x.astype(np.float64)
    exact = stat == np.float64
    np.testing.assert_allclose(mean, x64.mean(axis=(0, 2)), rtol=1e-12 if exact else 1e-6)
    np.testing.assert_allclose(var, x64.var(axis=(0, 2)), rtol=1e-9 if exact else 1e-3, atol=1e-12)


def test_a_large_gemm_is_one_blas_call_inside_a_split_and_blocks_on_the_team_outside(monkeypatch):
    """OpenBLAS runs on one thread: the CPU backend splits a large product into blocks of c's
    longer side, one per free thread, called by the compiled team (gemm_team); inside a run of
    split_work (already one thread) it is one call."""
    import lamina as lm
    from lamina.backends.cpu import _kernels
    from lamina.threads import split_work
    be = CPUBackend("openblas")
    calls, teams = [], []

    class Counting:
        def __init__(self, blas):
            self.blas = blas

        def gemm(self, *args):
            calls.append(args[2].shape)
            self.blas.gemm(*args)
    be.blas = Counting(be.blas)
    team = _kernels.gemm_team
    monkeypatch.setattr(_kernels, "gemm_team", lambda *args: teams.append(args[-2:]) or team(*args))
    rng = rng_for("split gemm")
    a, b = rng.standard_normal((4097, 125)).astype(np.float32), rng.standard_normal((125, 33)).astype(np.float32)
    assert 4097 * 125 * 33 >= GEMM_SPLIT_MIN  # (large enough to split)
    before = lm.get_num_threads()
    try:
        lm.set_num_threads(2)
        c = np.empty((4097, 33), np.float32)
        be.gemm(a, b, c)
        assert teams == [(2, True)] and calls == []  # rows, the longer side, in two blocks
        close(c, a.astype(np.float64) @ b, np.float32)
        teams.clear()
        be.gemm(a[:257], b, c[:257])
        assert teams == [] and calls == [(257, 33)]  # a small product: one call
        calls.clear()
        split_work(2, lambda t, items: be.gemm(a, b, np.empty((4097, 33), np.float32)))
        assert teams == [] and calls == [(4097, 33), (4097, 33)]
    finally:
        lm.set_num_threads(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_gemm_on_the_team_equals_one_call_in_every_block_shape(dtype, trans_a, trans_b):
    """gemm_team: c cut into blocks of rows or columns (uneven sizes, strided views of larger
    arrays, with beta or with a bias) equals the one-call product on 1, 2 and 3 pieces."""
    from lamina.backends.cpu import _kernels, _openblas
    function = _openblas.gemm_functions()[dtype == np.float64]
    rng = rng_for("gemm team", trans_a, trans_b)
    m, n, k = 53, 71, 19
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(dtype)
    wide = rng.standard_normal((n + 5, k + 3) if trans_b else (k + 3, n + 5)).astype(dtype)  # (b: a strided view)
    b = wide[:n, :k] if trans_b else wide[:k, :n]
    bias = rng.standard_normal(n).astype(dtype)
    want = 0.5 * (a.T if trans_a else a).astype(np.float64) @ (b.T if trans_b else b)
    c0 = rng.standard_normal((m, n + 2)).astype(dtype)
    for by_rows in (True, False):
        for pieces in (1, 2, 3):
            c = c0.copy()
            _kernels.gemm_team(function, a, b, c[:, :n], trans_a, trans_b, 0.5, 2.0, None, pieces, by_rows)
            close(c[:, :n], want + 2.0 * c0[:, :n], dtype)
            assert np.array_equal(c[:, n:], c0[:, n:])  # (outside the view: untouched)
            _kernels.gemm_team(function, a, b, c[:, :n], trans_a, trans_b, 0.5, 0.0, bias, pieces, by_rows)
            close(c[:, :n], want + bias, dtype)
    with pytest.raises(ValueError, match="bias must hold 71 values"):
        _kernels.gemm_team(function, a, b, c[:, :n], trans_a, trans_b, 1.0, 0.0, bias[:3], 2, True)


def test_a_compiled_team_runs_all_its_members_at_once():
    """team.h runs a kernel's members at the same time (each waits here for all the others), on
    distinct CPUs where the process has one for each member, and again after its workers were
    sent to sleep; members beyond the CPUs still run (the system shares the CPUs)."""
    import os
    from lamina.backends.cpu import _kernels
    cpus = len(os.sched_getaffinity(0))
    for threads in (1, 2, 3, 5):
        size, met, where = _kernels.team_roll_call(threads)
        assert size == threads and met == threads
        if threads <= cpus:
            assert len(set(where)) == threads
    _kernels.team_rest()
    assert _kernels.team_roll_call(2)[:2] == (2, 2)
    with pytest.raises(ValueError, match="1 to 256 threads, found 0"):
        _kernels.team_roll_call(0)


def test_loops_on_the_team_give_the_one_thread_values_on_any_team():
    """The element-wise, bias, normalization, attention, depthwise and optimizer kernels share
    their loops among lamina's team (team.h) above their thresholds: on 1, 2 and 3 threads each
    value is computed by the same code whichever member takes it, so the results agree to the
    bit, float32 and float64 (and the optimizers' spans and rows agree with the reference)."""
    import lamina as lm
    rng = rng_for("team loops")
    be = CPUBackend()
    starts = np.array([0, 70, 120, 210, 213], np.int32)  # (Σ length² · E above PARALLEL_MIN)
    heads, E = 4, 64

    def results(dtype):
        x = rng_for("team loops x").standard_normal((2100, 160)).astype(dtype)
        out = {}
        for kind in ("gelu", "relu", "tanh"):
            out[kind] = np.empty_like(x)
            be.activation(kind, x, out[kind])
            out[kind + " grad"] = np.ones_like(x)
            be.activation_backward(kind, x if kind == "gelu" else out[kind], x, out[kind + " grad"], beta=0.5)
        out["axpby"] = x[::-1].copy()
        be.axpby(0.25, x, -2.0, out["axpby"])
        out["channel bias"] = x.reshape(3, 700, 160).copy()
        be.channel_bias(out["channel bias"], x.reshape(-1)[:700].copy(), beta=0.5)
        out["norm"], mean, rstd = np.empty_like(x), np.empty(len(x), dtype), np.empty(len(x), dtype)
        gamma, beta = x[0] + 1, x[1]
        be.layer_norm(x, gamma, beta, 1e-5, out["norm"], mean, rstd)
        out["norm dx"], out["dgamma"], out["dbeta"] = np.ones_like(x), np.ones(160, dtype), np.ones(160, dtype)
        be.layer_norm_backward(x, x[::-1].copy(), mean, rstd, gamma, out["norm dx"], 0.5, out["dgamma"], 0.5,
                               out["dbeta"], 0.5)
        qkv = rng_for("team loops qkv").standard_normal((starts[-1], 3 * E)).astype(dtype)
        out["attention"], lse = np.empty((starts[-1], E), dtype), np.empty((starts[-1], heads), dtype)
        be.attention(qkv, starts, heads, 0.125, False, out["attention"], lse)
        out["dqkv"] = np.empty_like(qkv)
        be.attention_backward(qkv, out["attention"], lse, qkv[:, :E].copy(), starts, heads, 0.125, False,
                              out["dqkv"])
        out["depthwise by planes"], out["depthwise by channels"] = depthwise.run({"x": images.astype(dtype)}).values()
        out.update(updates(x, dtype))
        return out

    def updates(x, dtype, be=be):
        """Each optimizer's update of a parameter of 336,000 values (21 spans), and of 1,000 of
        its rows."""
        out, g = {}, x[::-1].copy()
        rows = np.sort(rng_for("team loops rows").choice(len(x), 1000, replace=False)).astype(np.int32)
        for name, call in {
                "sgd": lambda p, s1, s2: be.sgd_update(p, g, s1, 0.1, 0.9, 0.1, True, 0.01),
                "adam": lambda p, s1, s2: be.adam_update(p, g, s1, s2, 0.1, 0.9, 0.999, 1e-8, 0.01, False, 3),
                "adamw": lambda p, s1, s2: be.adam_update(p, g, s1, s2, 0.1, 0.9, 0.999, 1e-8, 0.01, True, 3),
                "adagrad": lambda p, s1, s2: be.adagrad_update(p, g, s1, 0.1, 1e-10, 0.01),
                "rmsprop": lambda p, s1, s2: be.rmsprop_update(p, g, s1, s2, 0.1, 0.99, 1e-8, 0.01, 0.9),
                "sgd rows": lambda p, s1, s2: be.sgd_update_rows(p, g, s1, rows, 0.1, 0.9, 0.1, False),
                "adam rows": lambda p, s1, s2: be.adam_update_rows(p, g, s1, s2, rows, 0.1, 0.9, 0.999, 1e-8, 3),
                "adagrad rows": lambda p, s1, s2: be.adagrad_update_rows(p, g, s1, rows, 0.1, 1e-10)}.items():
            p, s1, s2 = x.copy(), np.abs(np.roll(x, 1)), np.abs(np.roll(x, 2))
            call(p, s1, s2)
            out[name], out[name + " state"], out[name + " second state"] = p, s1, s2
        return out

    depthwise = lm.Network()  # (a plane of 56², and stride 2: by planes and by vectors of channels)
    images = rng_for("team loops images").standard_normal((2, 32, 56, 56))
    image = depthwise.input("x", (32, 56, 56))
    depthwise.outputs(planes=lm.layers.Conv2d(32, 32, 3, padding=1, groups=32)(image),
                      channels=lm.layers.Conv2d(32, 32, 3, stride=2, padding=1, groups=32)(image))

    before = lm.get_num_threads()
    try:
        for dtype in (np.float32, np.float64):
            depthwise.astype(dtype)
            found = []
            for threads in (1, 2, 3):
                lm.set_num_threads(threads)
                found.append(results(dtype))
            for other in found[1:]:
                for name, values in found[0].items():
                    assert np.array_equal(values, other[name]), (dtype.__name__, name)
            x = rng_for("team loops x").standard_normal((2100, 160)).astype(dtype)
            # every span and row in its place: the reference's arithmetic is in the arrays' type, the
            # kernels' in double, so they differ by a few roundings of terms of magnitude 1 + |x|
            scale = 1 + np.abs(np.stack([x, np.roll(x, 1), np.roll(x, 2)])).max(axis=0)
            for name, want in updates(x, dtype, ReferenceBackend()).items():
                assert np.all(np.abs(found[0][name] - want) <= 32 * np.finfo(dtype).eps * scale), (dtype.__name__, name)
            assert np.all(np.isfinite(found[0]["dqkv"])) and np.abs(found[0]["gelu grad"]).max() > 0
    finally:
        lm.set_num_threads(before)


def test_the_fused_recurrence_takes_no_more_threads_than_its_batch_has_shares():
    """Asked for more threads than the batch has sequences (by rows), the fused recurrence runs on
    as many as it has, with the one-thread result: none waits for a member that has no share."""
    from lamina.backends.cpu import _kernels
    rng = rng_for("team size")
    starts, H = np.array([0, 2, 3], np.int64), 32
    g0 = rng.standard_normal((3, 4 * H)).astype(np.float32)
    packed = np.empty(_kernels.panel_count(4 * H, 4) * H * 16, np.float32)
    _kernels.panel_pack(rng.standard_normal((4 * H, H)).astype(np.float32) / 8, True, 1.0, packed)
    rows = np.arange(3, dtype=np.int32)
    results = []
    for threads in (1, 3):
        g, hs, cs, out = g0.copy(), np.zeros((3, H), np.float32), np.zeros((3, H), np.float32), np.zeros((3, H), np.float32)
        _kernels.recurrence_forward(2, starts, g, g, g[0], False, packed, hs, cs, True, hs, False,
                                    hs, False, out, rows, 0, threads, True)
        results.append(out)
    assert np.abs(results[0]).max() > 0.1
    np.testing.assert_array_equal(results[1], results[0])
    with pytest.raises(ValueError, match="threads must be at least 1, found 0"):
        _kernels.recurrence_forward(2, starts, g, g, g[0], False, packed, hs, cs, True, hs, False,
                                    hs, False, out, rows, 0, 0, True)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_arrays_start_on_a_cache_line(dtype):
    """The CPU backend's buffers, workspaces and packed weights start at a multiple of 64 bytes
    (numpy's own allocations are only 16-byte aligned, and the kernels' 32-byte vectors then
    cross cache lines), and hold what a plain numpy array of the same shape would."""
    from lamina.backends.cpu.aligned import aligned_copy, aligned_empty
    be = CPUBackend(blas="openblas")
    for shape in [(0,), (1,), (3, 5), (7, 1, 9), 13]:
        for _ in range(4):  # allocations in a row land at varied offsets from numpy's allocator
            a = be.empty(shape, dtype)
            assert (a.size == 0 or a.ctypes.data % 64 == 0) and a.dtype == dtype and a.flags.c_contiguous
            assert a.shape == ((shape,) if isinstance(shape, int) else shape)
    rng = rng_for("aligned", dtype)
    b = rng.standard_normal((37, 21)).astype(dtype)
    packed = be.pack(b)
    assert packed.panels.ctypes.data % 64 == 0
    c = aligned_copy(b.T, np.float64)
    assert c.ctypes.data % 64 == 0 and c.flags.c_contiguous and np.array_equal(c, b.T.astype(np.float64))
    assert aligned_empty((4, 4), dtype, align=256).ctypes.data % 256 == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,n_in,n_out", [("nearest", 5, 11), ("linear", 5, 11), ("linear", 9, 4),
                                             ("nearest", 1, 3), ("linear", 300, 600)])
def test_resample_axis(backend, dtype, mode, n_in, n_out):
    """Both directions against the reference, on outer x inner shapes that split into spans."""
    from lamina.layers.resize import resampling_table
    taps, weights = resampling_table(n_in, n_out, n_out / n_in, mode, "half_pixel", "round_prefer_floor")
    weights = weights.astype(dtype)
    rng = rng_for("resample", mode, n_in, n_out)
    for outer, inner in ((1, 1), (3, 7), (2, 300)):
        x = rng.standard_normal((outer, n_in, inner)).astype(dtype)
        y, y_ref = np.full((outer, n_out, inner), np.nan, dtype), np.empty((outer, n_out, inner), dtype)
        backend.resample_axis(x, taps, weights, y)
        REF.resample_axis(x, taps, weights, y_ref)
        close(y, y_ref, dtype)
        dy = rng.standard_normal(y.shape).astype(dtype)
        for beta in (0.0, 1.0):
            dx, dx_ref = out_pair(x.shape, dtype, beta, rng)
            backend.resample_axis_backward(dy, taps, weights, dx, beta)
            REF.resample_axis_backward(dy, taps, weights, dx_ref, beta)
            close(dx, dx_ref, dtype)

