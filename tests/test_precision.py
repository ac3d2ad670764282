"""bfloat16 inference (lamina.precision): the rounding kernel and the bfloat16 packed product on
every backend against numpy, and layers in bfloat16 against float32 within bounds derived from
the precision (the shipped language model's perplexity in each precision: test_quantize.py).

Bounds. Rounding to bfloat16 (8 significant bits, to nearest) moves a value by at most half a
unit in its last place, u = 2^-8 of itself, so a product of two rounded operands is within 2u + u² of the exact one,
and a dot product within (2u + u²)·Σ|a||b|. The bfloat16 products themselves are exact in
float32 (8 x 8 bits), so against float64 products of the rounded operands the only error left
is float32 accumulation: k·2^-24·Σ|a||b| for a depth of k."""

import itertools

import numpy as np
import pytest

import lamina as lm
from helpers import one_layer_network, one_step_sequences
from lamina.backends.reference import ReferenceBackend
from lamina.precision import bfloat16_bits, from_bfloat16_bits, round_bfloat16

U = 2.0 ** -8
PRODUCT = 2 * U + U * U
REF = ReferenceBackend()


def test_rounding_to_nearest_even_on_the_bits():
    x = np.array([1.0, 1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -8 + 2 ** -20, -0.0, np.inf, -np.inf, 3.4e38,
                  1e-40, np.nan], np.float32)
    bits = bfloat16_bits(x)
    # 1 + 2^-8 is a tie: to even (1.0); 1 + 3·2^-8 a tie: to even (1 + 2^-6); above a tie: up
    assert list(bits[:4]) == [0x3F80, 0x3F80, 0x3F82, 0x3F81]
    assert list(bits[4:8]) == [0x8000, 0x7F80, 0xFF80, 0x7F80]  # the largest float32 rounds to inf
    assert np.isnan(from_bfloat16_bits(bits[-1:]))[0]
    rng = np.random.default_rng(0)
    y = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(np.float32)
    r = round_bfloat16(y)
    assert np.all(np.abs(r - y) <= U * np.abs(y))
    assert np.all((r.view(np.uint32) & 0xFFFF) == 0)


@pytest.mark.parametrize("n", [1, 33, 100_003])
def test_round_to_bfloat16_kernel(backend, n):
    rng = np.random.default_rng(n)
    x = (rng.standard_normal(n) * 100).astype(np.float32)
    x[:min(n, 4)] = np.array([np.nan, np.inf, -0.0, 1 + 2 ** -8], np.float32)[:min(n, 4)]
    y = np.empty_like(x)
    backend.round_to_bfloat16(x, y)
    np.testing.assert_array_equal(y.view(np.uint32), round_bfloat16(x).view(np.uint32))


@pytest.mark.parametrize("trans", [False, True])
# (600 rows: more than a pack serves, the plain GEMM of the reduced values where float32 products serve)
@pytest.mark.parametrize("m,k,n,alpha", [(1, 7, 5, 1.0), (64, 256, 1024, 1.0), (30, 100, 70, 0.5), (600, 130, 40, 1.0)])
def test_bfloat16_packed_product(reduced_backend, trans, m, k, n, alpha):
    backend = reduced_backend
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans else (k, n)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    op_b = b.T if trans else b
    exact = alpha * (round_bfloat16(a).astype(np.float64) @ round_bfloat16(op_b).astype(np.float64))
    accumulation = k * 2.0 ** -24 * abs(alpha) * (np.abs(a) @ np.abs(op_b)) + 1e-30
    packed = backend.pack(b, trans, alpha, m, precision="bfloat16")
    c = np.full((m, n), 7.0, np.float32)
    backend.packed_gemm(a, packed, c, beta=1.0)
    assert np.all(np.abs(c - (exact + 7.0)) <= accumulation + 7.0 * 2.0 ** -23)
    backend.packed_gemm_bias(a, packed, c, bias)
    assert np.all(np.abs(c - (exact + bias)) <= accumulation + np.abs(bias) * 2.0 ** -23)
    # and it is a bfloat16 product, not a float32 one: the float32 result lies outside the bound
    full = alpha * (a.astype(np.float64) @ op_b.astype(np.float64))
    assert np.all(np.abs(c - (full + bias)) <= PRODUCT * abs(alpha) * (np.abs(a) @ np.abs(op_b)) + 1e-5)
    if k >= 100:
        assert np.abs(c - (full + bias)).max() > accumulation.max()


@pytest.mark.parametrize("trans_a,trans_b", [(False, False), (True, False), (False, True), (True, True)])
def test_bfloat16_gemm_in(reduced_backend, trans_a, trans_b):
    """The products of autocast training (Backend.gemm_in in bfloat16): both operands rounded,
    summed in float32, with alpha and beta, into a block of columns of a larger matrix too."""
    backend = reduced_backend
    rng = np.random.default_rng(int(trans_a) + 2 * int(trans_b))
    m, k, n = 37, 131, 21
    a = rng.standard_normal((k, m) if trans_a else (m, k)).astype(np.float32)
    b = rng.standard_normal((n, k) if trans_b else (k, n)).astype(np.float32)
    op_a, op_b = (a.T if trans_a else a), (b.T if trans_b else b)
    exact = round_bfloat16(op_a).astype(np.float64) @ round_bfloat16(op_b).astype(np.float64)
    accumulation = k * 2.0 ** -24 * (np.abs(op_a) @ np.abs(op_b)) * 1.01
    whole = rng.standard_normal((m, n + 5)).astype(np.float32)
    # (a block of columns: the CPU's; the device adapters take whole arrays)
    for c in (whole[:, :n].copy(),) + ((whole[:, 2:n + 2],) if isinstance(backend, lm.CPUBackend) else ()):
        before = c.astype(np.float64)
        backend.gemm_in("bfloat16", a, b, c, trans_a, trans_b, alpha=0.5, beta=2.0)
        assert np.all(np.abs(c - (0.5 * exact + 2.0 * before)) <= 0.5 * accumulation + 4 * 2.0 ** -24 * np.abs(c))
    assert np.abs(c - (0.5 * op_a.astype(np.float64) @ op_b + 2.0 * before)).max() > accumulation.max()


def _bf16_kernel_expected():
    from lamina.backends.cpu import compiled
    from lamina.processor import instruction_sets
    return compiled.PATH in ("amx", "avx512") and {"avx512_bf16", "avx512vl"} <= set(instruction_sets())


def test_bfloat16_products_run_lamina_panels_where_the_cpu_has_avx512_bf16():
    """lamina's bfloat16 panels (vdpbf16ps) in the AVX-512 build on a CPU with AVX512-BF16, where
    lamina's own products serve the reduced precisions; elsewhere float32 products of the rounded
    operands (LAMINA_ISA=avx2 takes that path on the same CPU); `lamina devices` names the one taken."""
    import subprocess
    import sys
    from lamina.backends.cpu import compiled
    runs = _bf16_kernel_expected()
    assert compiled._kernels.bf16_kernel_runs() == runs
    be = lm.CPUBackend("openblas", "lamina")
    packed = be.pack(np.ones((5, 3), np.float32), True, 1.0, 2, precision="bfloat16")
    assert packed.provider == ("bf16-panels" if runs else "panels") and (packed.operands is None) == runs
    if lm.CPUBackend().low_precision == "lamina":
        out = subprocess.run([sys.executable, "-m", "lamina.cli", "devices"], capture_output=True, text=True)
        line = ("float32 products of the operands rounded to bfloat16" if not runs else
                "lamina's bfloat16 panels, AMX tiles" if compiled.PATH == "amx" else
                "lamina's bfloat16 panels, AVX512-BF16")
        assert f"bfloat16 products: {line}" in out.stdout, out.stdout


@pytest.mark.skipif(not _bf16_kernel_expected(), reason="lamina's bfloat16 panels need AVX512-BF16 and the AVX-512 "
                    "build (elsewhere test_bfloat16_packed_product covers the float32 products that serve)")
@pytest.mark.parametrize("k", [1, 2, 5, 64, 257])
def test_lamina_bfloat16_panels_at_every_tile_edge(k):
    """Every tile of rows (6, 4, 2 and 1; on AMX tiles, 2 x 2, 1 x 2, 2 x 1 and 1 x 1 tiles of 16
    rows x 16 channels over several blocks of rows, and the rows short of a tile), an odd depth's
    last pair, a panel of fewer than 16 channels, shared by panels and by rows on two threads, with
    alpha, bias or beta, op(a) given as a or as the columns of its transpose (16 rows at a time and
    a shorter last block): the float64
    product of the rounded operands within float32 accumulation. The pack on two threads equals
    the pack on one."""
    from lamina.backends.cpu.compiled import _kernels as K
    rng = np.random.default_rng(k)
    n = 37
    for trans in (False, True):
        b = rng.standard_normal((n, k) if trans else (k, n)).astype(np.float32)
        op_b = b.T if trans else b
        packed, on_two = (np.empty(K.bf16_pack_size(k, n), np.uint16) for _ in range(2))
        K.bf16_pack(b, trans, packed)
        K.bf16_pack(b, trans, on_two, threads=2)
        np.testing.assert_array_equal(on_two, packed)
        for (m, threads, by_rows), trans_a in itertools.product(
                ((13, 1, False), (11, 2, False), (23, 2, True), (1, 2, True), (40, 2, False), (150, 2, True),
                 (150, 1, False)), (False, True)):
            a = rng.standard_normal((m, k)).astype(np.float32)
            given = np.ascontiguousarray(a.T) if trans_a else a
            u = np.empty((m, K.bf16_row_values(k)), np.uint16)
            exact = round_bfloat16(a).astype(np.float64) @ round_bfloat16(op_b).astype(np.float64)
            bound = k * 2.0 ** -24 * (np.abs(a) @ np.abs(op_b)) * 1.01 + 1e-30
            bias = rng.standard_normal(n).astype(np.float32)
            c = rng.standard_normal((m, n)).astype(np.float32)
            before = c.astype(np.float64)
            K.bf16_product(given, packed, 0.5, c, 2.0, None, u, threads=threads, by_rows=by_rows, trans_a=trans_a)
            assert np.all(np.abs(c - (0.5 * exact + 2.0 * before)) <= 0.5 * bound + 4 * 2.0 ** -24 * np.abs(c))
            K.bf16_product(given, packed, 1.0, c, 0.0, bias, u, threads=threads, by_rows=by_rows, trans_a=trans_a)
            assert np.all(np.abs(c - (exact + bias)) <= bound + 2 * 2.0 ** -24 * np.abs(c)), (trans, m, threads)
            # stored transposed into columns 3.. of a wider matrix (a convolution's output block), through
            # a ReLU capped at 0.5 (NaN-free: the cap and the floor are exact)
            wide = np.full((n, m + 5), 7.0, np.float32)
            K.bf16_product(given, packed, 1.0, wide[:, 3:3 + m], 0.0, bias, u, threads=threads, by_rows=by_rows,
                           trans_a=trans_a, trans_c=True, act=2, cap=0.5)
            capped = np.clip(exact + bias, 0, 0.5).T
            assert np.all(np.abs(wide[:, 3:3 + m] - capped) <= bound.T + 2 * 2.0 ** -24), (trans, m, threads)
            assert (wide[:, :3] == 7).all() and (wide[:, 3 + m:] == 7).all()
    with pytest.raises(ValueError, match="take"):
        K.bf16_product(a, packed[:-1], 1.0, c, 0.0, None, u)
    with pytest.raises(ValueError, match=rf"must be \(37, {len(a)}\)"):
        K.bf16_product(a, packed, 1.0, np.empty((n, len(a) + 1), np.float32), 0.0, None, u, trans_c=True)
    with pytest.raises(ValueError, match="act must be"):
        K.bf16_product(a, packed, 1.0, c, 0.0, None, u, act=3)


def test_a_bfloat16_row_with_nan_or_infinity_gives_no_finite_number(reduced_backend):
    """NaN stays NaN through the rounding and the products, and an infinite operand makes its
    row's outputs infinite or NaN: never a finite number that looks right."""
    rng = np.random.default_rng(6)
    a = rng.standard_normal((5, 40)).astype(np.float32)
    a[1, 7], a[2, 39], a[3, 0] = np.nan, np.inf, -np.inf
    c = np.empty((5, 21), np.float32)
    reduced_backend.packed_gemm(a, reduced_backend.pack(rng.standard_normal((21, 40)).astype(np.float32), True, 1.0,
                                                        5, "bfloat16"), c)
    assert np.isnan(c[1]).all() and not np.isfinite(c[2:4]).any() and np.isfinite(c[[0, 4]]).all()


@pytest.mark.parametrize("kind", ["Linear", "RNN", "LSTM", "GRU"])
def test_layers_in_bfloat16_are_within_the_precision_of_float32(kind, low_precision):
    """One step from a zero state: each gate pre-activation is x W_ihᵀ + b, within
    PRODUCT·(|x| |W_ih|ᵀ) of float32's; the cell passes it through functions whose slopes bound
    how far the output moves (RNN tanh: 1; LSTM: 1/4 + 1/4 + 1 over the o, i and g gates; GRU
    from h0 = 0: 1/4 (z) + 1 (n) + 1/4 |b_hn| (r))."""
    width, hidden = 96, 64
    make = {"Linear": lambda: lm.layers.Linear(width, hidden), "RNN": lambda: lm.layers.RNN(width, hidden),
            "LSTM": lambda: lm.layers.LSTM(width, hidden), "GRU": lambda: lm.layers.GRU(width, hidden)}[kind]
    f32, b16 = one_layer_network(make, width), one_layer_network(make, width, low_precision).astype("bfloat16")
    assert b16.precision == "bfloat16"
    seqs = one_step_sequences(40, width, 1)
    want, got = (np.asarray(getattr(net.run({"x": seqs})["y"], "values", None) if kind != "Linear"
                            else net.run({"x": seqs})["y"].values) for net in (f32, b16))
    layer = f32.layers[0]
    w = layer.params["weight" if kind == "Linear" else "weight_ih_l0"].value
    e = PRODUCT * (np.abs(seqs.values) @ np.abs(w).T)  # [rows, gates·hidden]
    gates = e.reshape(len(e), -1, hidden).max(axis=1)
    if kind == "GRU":
        slope = 1.25 + 0.25 * np.abs(layer.params["bias_hh_l0"].value[2 * hidden:]).max()
    else:
        slope = {"Linear": 1.0, "RNN": 1.0, "LSTM": 1.5}[kind]
    assert np.all(np.abs(got - want) <= slope * gates + 1e-6)
    assert np.abs(got - want).max() > 0  # the products did run in bfloat16


def test_the_bfloat16_network_uses_the_reference_semantics_everywhere(low_precision):
    """The CPU's bfloat16 products (MKL's, or float32 ones of the rounded operands) and the
    composed form on the core-only reference give the same layer outputs, up to float32
    accumulation (a step apart, a rounding of h may flip)."""
    from lamina.testing import core_only
    width, hidden = 48, 32
    seqs = one_step_sequences(20, width, 2)
    cpu = one_layer_network(lambda: lm.layers.LSTM(width, hidden), width, low_precision).astype("bfloat16")
    core = one_layer_network(lambda: lm.layers.LSTM(width, hidden), width).to(core_only(ReferenceBackend)()).astype("bfloat16")
    np.testing.assert_allclose(core.run({"x": seqs})["y"].values, cpu.run({"x": seqs})["y"].values,
                               rtol=0, atol=width * 2.0 ** -22)


def test_bfloat16_is_an_inference_setting_that_saves_and_loads(tmp_path):
    net = one_layer_network(lambda: lm.layers.LSTM(16, 8), 16).astype("bfloat16")
    lm.save(net, tmp_path / "m.lamina")
    assert lm.load(tmp_path / "m.lamina").precision == "bfloat16"
    assert net.astype("float32").precision == "float32"
    with pytest.raises(ValueError, match="must be float32"):
        one_layer_network(lambda: lm.layers.LSTM(16, 8), 16).astype("float64").astype("bfloat16")


def test_bfloat16_layers_agree_on_every_backend(low_precision):
    """A bfloat16 LSTM and Linear on each device backend (and the core-only reference) against
    the CPU's, one step from a zero state: the rounded operands are the same everywhere and their
    products exact in float32, so only the order of the float32 sums differs."""
    from conftest import OPENCL_DEVICES
    from lamina.testing import core_only
    backends = [core_only(ReferenceBackend)()]
    if OPENCL_DEVICES:
        from lamina.backends.opencl import OpenCLBackend
        backends += [OpenCLBackend(i) for i in range(len(OPENCL_DEVICES))]
    width, hidden = 64, 48
    seqs = one_step_sequences(24, width, 3)
    for make in (lambda: lm.layers.LSTM(width, hidden), lambda: lm.layers.Linear(width, hidden)):
        want = one_layer_network(make, width, low_precision).astype("bfloat16").run({"x": seqs})["y"].values
        for be in backends:
            got = one_layer_network(make, width).to(be).astype("bfloat16").run({"x": seqs})["y"].values
            np.testing.assert_allclose(got, want, rtol=0, atol=width * 2.0 ** -22, err_msg=str(be))


def _sequence_regression(make, width=32, out=8, seed=3):
    """A recurrent (or dense) layer, a Linear and a square error over ragged sequences."""
    lm.manual_seed(seed)
    net = lm.Network()
    x, t = net.input("x", width, sequence=True), net.input("t", out, sequence=True)
    y = make()(x)
    y = y[0] if isinstance(y, tuple) else y
    net.outputs(loss=lm.layers.SquareError()(lm.layers.Linear(y.spec.shape[0], out)(y), t))
    return net


def _batch(width=32, out=8, seed=0):
    rng = np.random.default_rng(seed)
    lengths = (5, 9, 3, 7)
    return {"x": lm.Sequences.from_list([rng.standard_normal((n, width)).astype(np.float32) for n in lengths]),
            "t": lm.Sequences.from_list([rng.standard_normal((n, out)).astype(np.float32) for n in lengths])}


def _gradients(net, feeds):
    from lamina.parameter import host
    net.zero_grad()
    net.forward(feeds)
    loss = net.backward()
    return loss, {p.name: np.array(host(p.grad)) for p in net.parameters()}


def test_autocast_trains_a_linear_layer_with_bfloat16_products():
    """One Linear under autocast: dW = dZᵀ X and dX = dZ W with both operands rounded, within
    PRODUCT·Σ|dz||x| of float32's; the weights stay float32 (the optimizer's masters)."""
    lm.manual_seed(1)
    rng = np.random.default_rng(1)
    net = lm.Network()
    x, t = net.input("x", 64), net.input("t", 16)
    x.requires_grad = True
    z = lm.layers.Linear(64, 16, bias=False)(x)
    net.outputs(loss=lm.layers.SquareError()(z, t))
    feeds = {"x": rng.standard_normal((20, 64)).astype(np.float32), "t": rng.standard_normal((20, 16)).astype(np.float32)}
    _, want = _gradients(net, feeds)
    dx_want = np.array(net.grad("x"))
    w = net.layers[0].params["weight"].value.copy()
    net.autocast("bfloat16")
    _, got = _gradients(net, feeds)
    # the forward's z moves by at most PRODUCT·|x||w|, which moves dz = (z - t)/rows by as much
    dz = (feeds["x"] @ w.T - feeds["t"]) / 20
    dz_error = PRODUCT * (np.abs(feeds["x"]) @ np.abs(w).T) / 20
    bound = PRODUCT * (np.abs(dz).T @ np.abs(feeds["x"])) + dz_error.T @ np.abs(feeds["x"]) * (1 + PRODUCT) + 1e-7
    key = net.layers[0].params["weight"].name
    assert np.all(np.abs(got[key] - want[key]) <= bound)
    assert np.abs(got[key] - want[key]).max() > 0  # the products did run in bfloat16
    dx_bound = PRODUCT * (np.abs(dz) @ np.abs(w)) + dz_error @ np.abs(w) * (1 + PRODUCT) + 1e-7
    assert np.all(np.abs(np.array(net.grad("x")) - dx_want) <= dx_bound)
    np.testing.assert_array_equal(net.layers[0].params["weight"].value, w)  # masters untouched
    assert net.training_precision == "bfloat16" and net.precision == "float32"


@pytest.mark.parametrize("path,shared", [("sparse", False), ("sparse", True), ("dense", False)])
def test_selective_linear_multiplies_in_bfloat16_under_autocast_on_every_backend(path, shared):
    """SelectiveLinear under autocast, on each of its paths: scores and gradients on the CPU and
    each OpenCL device equal the core-only reference's (x and W rounded to bfloat16, float64 sums)
    within float32 summation, and are not float32's."""
    from conftest import OPENCL_DEVICES
    from lamina.testing import core_only
    rng = np.random.default_rng(8)
    rows, width, out = 30, 70, 60
    lists = [rng.choice(out, 9, replace=False).astype(np.int32) for _ in range(rows)]
    sel = lm.Selection.shared(lists[0]) if shared else lm.Selection.from_lists(lists)
    labels = (rng.choice(lists[0], rows) if shared else np.array([c[0] for c in lists])).astype(np.int32)
    feeds = {"x": rng.standard_normal((rows, width)).astype(np.float32), "sel": sel, "y": labels}

    def network():
        lm.manual_seed(2)
        net = lm.Network()
        x, s, y = net.input("x", width), net.input("sel", dtype="selection"), net.input("y", dtype="int32")
        x.requires_grad = True
        scores = lm.layers.SelectiveLinear(width, out, path=path)(x, s)
        net.outputs(scores=scores, loss=lm.layers.SelectedCrossEntropy()(scores, y, s))
        return net

    def run(backend, precision):
        from lamina.parameter import host
        net = (network() if backend is None else network().to(backend)).autocast(precision)
        net.zero_grad()
        out = net.forward(feeds)["scores"]
        scores = np.array(host(out.values if isinstance(out, lm.Sequences) else out))
        net.backward()
        return {**{p.name: np.array(host(p.grad)) for p in net.parameters()}, "x": np.array(host(net.grad("x"))),
                "scores": scores}

    want, float32 = run(core_only(ReferenceBackend)(), "bfloat16"), run(None, "float32")
    backends = [None] + ([__import__("lamina.backends.opencl", fromlist=["OpenCLBackend"]).OpenCLBackend(0)]
                         if OPENCL_DEVICES else [])
    chosen = np.unique(np.concatenate(lists[:1] if shared else lists))  # (a sparse gradient's rows)
    for backend in backends:
        got = run(backend, "bfloat16")
        for key, value in want.items():
            rows = slice(None) if key in ("x", "scores") else chosen
            scale = np.abs(value[rows]).max()
            np.testing.assert_allclose(got[key][rows], value[rows], rtol=0, atol=2 ** -16 * scale,
                                       err_msg=f"{backend} {key}")
            assert np.abs(float32[key][rows] - value[rows]).max() > 2 ** -12 * scale, key  # bfloat16's products


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_autocast_recurrent_gradients_are_bfloat16_close_on_every_backend(kind):
    """A recurrent layer's gradients under autocast: within a few bfloat16 roundings (relative
    2^-5 of each tensor's largest) of float32's on the CPU, and the same products composed on the
    core-only reference and on each OpenCL device agree with the CPU's within one bfloat16 unit of one term (2^-8 of the
    largest, halved): their float32 sums differ in order, which may flip the rounding of a state
    a step later."""
    from lamina.testing import core_only
    make = {"LSTM": lambda: lm.layers.LSTM(32, 48), "GRU": lambda: lm.layers.GRU(32, 48),
            "RNN": lambda: lm.layers.RNN(32, 48)}[kind]
    feeds = _batch()
    loss32, want = _gradients(_sequence_regression(make), feeds)
    loss16, got = _gradients(_sequence_regression(make).autocast("bfloat16"), feeds)
    from conftest import OPENCL_DEVICES
    backends = [core_only(ReferenceBackend)()]
    if OPENCL_DEVICES:
        from lamina.backends.opencl import OpenCLBackend
        backends.append(OpenCLBackend(0))
    composed = [_gradients(_sequence_regression(make).to(be).autocast("bfloat16"), feeds)[1] for be in backends]
    assert abs(loss16 / loss32 - 1) < 2 ** -7
    moved = 0.0
    for key, g in want.items():
        scale = np.abs(g).max()
        assert np.abs(got[key] - g).max() <= 2 ** -5 * scale, key
        for be, grads in zip(backends, composed):
            np.testing.assert_allclose(grads[key], got[key], rtol=0, atol=2 ** -9 * scale, err_msg=f"{be} {key}")
        moved = max(moved, np.abs(got[key] - g).max() / scale)
    assert moved > 2 ** -20  # the products did run in bfloat16


@pytest.mark.parametrize("products", ["float32", "lamina"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_autocast_gradients_of_the_fused_recurrence_equal_the_step_by_step_ones(monkeypatch, kind, products):
    """Where float32 products serve bfloat16 (on lamina's panels), the fused recurrence rounds
    the states before each forward product and dG's rows before each backward one (with lamina's
    bfloat16 panels, where they run, both multiply by W_hh's bfloat16 panels), on one thread
    and shared by sequences and by units: the gradients equal the layer's steps one at a time
    (the same rounded operands; the float32 sums' order may flip a rounding, so nearly all
    elements agree to float32 rounding and every one within a bfloat16 unit of the largest)."""
    from lamina.backends.cpu import fused_recurrence
    make = {"LSTM": lambda: lm.layers.LSTM(32, 48), "GRU": lambda: lm.layers.GRU(32, 48),
            "RNN": lambda: lm.layers.RNN(32, 48)}[kind]
    rng = np.random.default_rng(4)
    lengths = (5, 9, 3, 7, 9, 2, 6, 8)  # (enough sequences for two threads to share them)
    feeds = {"x": lm.Sequences.from_list([rng.standard_normal((n, 32)).astype(np.float32) for n in lengths]),
             "t": lm.Sequences.from_list([rng.standard_normal((n, 8)).astype(np.float32) for n in lengths])}
    backend = lm.CPUBackend("openblas", products)
    calls, original = [], fused_recurrence._kernels.recurrence_backward
    monkeypatch.setattr(fused_recurrence._kernels, "recurrence_backward",
                        lambda *a, **k: calls.append(a[22] if len(a) > 22 else 0) or original(*a, **k))
    fused = []
    for share in ("auto", "rows", "units"):
        monkeypatch.setattr(fused_recurrence, "FUSED_SHARE", share)
        monkeypatch.setattr(fused_recurrence, "FUSED_PARALLEL_MIN", 0 if share != "auto" else 1 << 24)
        fused.append(_gradients(_sequence_regression(make).to(backend).autocast("bfloat16"), feeds)[1])
    assert calls == [fused_recurrence.BF16_PANELS if backend.bf16_panels else 1] * 3  # (reduce: the product's kind)
    monkeypatch.setattr(fused_recurrence, "fuses_in", lambda *a: False)
    _, stepwise = _gradients(_sequence_regression(make).to(backend).autocast("bfloat16"), feeds)
    _, float32 = _gradients(_sequence_regression(make).to(backend), feeds)
    for grads in fused:
        for key, want in stepwise.items():
            scale = np.abs(want).max()
            close = np.abs(grads[key] - want) <= 1e-6 * scale
            assert close.mean() >= 0.99 and np.abs(grads[key] - want).max() <= 2 ** -8 * scale, key
            if "weight_hh" in key:  # and they are bfloat16's gradients, not float32's
                assert (np.abs(float32[key] - want) > 1e-6 * scale).mean() > 0.5, key


def test_autocast_follows_float32_training_and_keeps_float32_weights():
    """40 Adam steps of an LSTM regression under autocast: the loss curve follows float32's (each
    of the last ten losses within 2%) and the weights stay float32, not rounded to bfloat16."""
    feeds = _batch()
    curves = []
    for precision in ("float32", "bfloat16"):
        net = _sequence_regression(lambda: lm.layers.LSTM(32, 48)).autocast(precision)
        opt = lm.optim.Adam(net, lr=3e-3)
        curves.append([net.train_step(feeds, opt) for _ in range(40)])
    curves = np.array(curves)
    assert curves[0, -1] < 0.7 * curves[0, 0]  # it did learn
    assert np.all(np.abs(curves[1, -10:] / curves[0, -10:] - 1) < 0.02), curves[:, -10:]
    w = net.layers[0].params["weight_ih_l0"].value
    assert np.any(w.view(np.uint32) & 0xFFFF)  # not bfloat16 values: float32 masters
    with pytest.raises(ValueError, match="'bfloat16' or 'float32'"):
        net.autocast("int8")


def test_astype_refuses_what_lamina_cannot_compute_in():
    net = one_layer_network(lambda: lm.layers.Linear(4, 2), 4)
    for dtype in (np.float16, "int8", np.int32):
        with pytest.raises(ValueError, match="computes in float32 or float64, found"):
            net.astype(dtype)
    assert net.dtype == np.float32 and net.astype(np.float64).dtype == np.float64


# (kind, layer, sample shape): products at least pointwise.BF16_MIN_DEPTH deep, so each forward multiplies in
# bfloat16: a pointwise convolution of few positions (the CPU's W panels) and of many (bfloat16 GEMMs), a strided
# 3x3 one (its column matrix; with a fused ReLU), a grouped pointwise one, and transposed ones (depth to space, and
# columns with overlapping windows)
_BF16_CONVS = {
    "pointwise, few positions": (lambda: lm.layers.Conv2d(128, 40, 1), (128, 5, 7)),
    "pointwise, many positions": (lambda: lm.layers.Conv2d(128, 24, 1), (128, 19, 17)),
    "3x3 stride 2 + ReLU": (lambda: (lm.layers.Conv2d(16, 20, 3, stride=2, padding=1), lm.layers.Activation("relu")),
                            (16, 15, 13)),
    "grouped pointwise": (lambda: lm.layers.Conv2d(256, 40, 1, groups=2), (256, 4, 5)),
    "transposed 3-D, kernel = stride": (lambda: lm.layers.ConvTranspose3d(16, 24, 2, stride=2), (16, 3, 4, 3)),
    "transposed, stride 2": (lambda: lm.layers.ConvTranspose2d(128, 8, 3, stride=2, padding=1), (128, 5, 4)),
}


@pytest.mark.parametrize("case", list(_BF16_CONVS))
def test_convolutions_multiply_in_bfloat16_on_every_backend(case):
    """A convolution under autocast (forward, input and weight gradients) and in a bfloat16
    network (forward) on the CPU and each OpenCL device equals the core-only reference's (input
    and weight rounded to bfloat16, float64 sums) within float32 summation, and is not
    float32's."""
    from conftest import OPENCL_DEVICES
    from lamina.parameter import host
    from lamina.testing import core_only
    make, shape = _BF16_CONVS[case]
    rng = np.random.default_rng(11)
    x = rng.standard_normal((3,) + shape).astype(np.float32)

    def network():
        lm.manual_seed(4)
        net = lm.Network()
        y = net.input("x", shape)
        y.requires_grad = True
        for layer in (lambda made: made if isinstance(made, tuple) else (made,))(make()):
            y = layer(y)
        net.outputs(y=y)
        return net

    # the output's gradient given (a cost's would follow y, whose float32 sums differ by backend, and
    # its rounding to bfloat16 could then differ)
    dy = rng.standard_normal(network().run({"x": x})["y"].shape).astype(np.float32)

    def run(backend, precision):
        net = network() if backend is None else network().to(backend)
        net.autocast(precision)
        net.zero_grad()
        out = {"y": np.array(host(net.forward({"x": x}, grad_outputs=["y"])["y"]))}
        net.backward(grad_outputs={"y": dy})
        out.update({"x grad": np.array(host(net.grad("x"))), **{p.name: np.array(host(p.grad))
                                                                 for p in net.parameters()}})
        inference = network() if backend is None else network().to(backend)
        out["inference"] = np.asarray(inference.astype(precision).run({"x": x})["y"])
        packs[backend] = {key[2] for key in inference.layers[0]._packs}
        return out

    packs = {}
    want, float32 = run(core_only(ReferenceBackend)(), "bfloat16"), run(None, "float32")
    backends = [None] + ([__import__("lamina.backends.opencl", fromlist=["OpenCLBackend"]).OpenCLBackend(0)]
                         if OPENCL_DEVICES else [])
    for backend in backends:
        got = run(backend, "bfloat16")
        for key, value in want.items():
            scale = np.abs(value).max()
            np.testing.assert_allclose(got[key], value, rtol=0, atol=2 ** -16 * scale, err_msg=f"{backend} {key}")
            if not key.endswith("bias"):  # (a bias gradient sums dy alone)
                assert np.abs(float32[key] - value).max() > 2 ** -12 * scale, key  # bfloat16's products
    if _bf16_kernel_expected() and lm.CPUBackend().low_precision == "lamina":
        # W's bfloat16 panels serve a one-group convolution of few positions (pointwise.bfloat16_forward)
        panels = case in ("pointwise, few positions", "3x3 stride 2 + ReLU")
        assert ("bfloat16" in packs[None]) == panels, packs[None]


def test_a_shallow_convolution_keeps_float32_products_in_a_bfloat16_run():
    """Below pointwise.BF16_MIN_DEPTH a pointwise convolution's forward in a bfloat16 run is its
    float32 forward over the weight's values (bfloat16 measured slower there); so is a transposed
    one over as few input channels, however large its kernel."""
    from lamina.backends.cpu import pointwise
    width = pointwise.BF16_MIN_DEPTH // 2
    lm.manual_seed(5)
    net = lm.Network()
    net.outputs(y=lm.layers.Conv2d(width, 8, 1)(net.input("x", (width, 6, 6))))
    x = np.random.default_rng(5).standard_normal((2, width, 6, 6)).astype(np.float32)
    net.astype("bfloat16")
    weight = net.layers[0].params["weight"].value.reshape(8, width)
    want = np.einsum("oc,ncp->nop", weight.astype(np.float64), x.reshape(2, width, -1).astype(np.float64))
    want += net.layers[0].params["bias"].value[:, None]
    got = net.run({"x": x})["y"].reshape(2, 8, -1)
    np.testing.assert_allclose(got, want, rtol=0, atol=width * 2.0 ** -22 * np.abs(want).max())
    lm.manual_seed(5)
    up = lm.Network()
    up.outputs(y=lm.layers.ConvTranspose2d(16, 16, 3, stride=2, padding=1)(up.input("x", (16, 7, 6))))
    x = np.random.default_rng(6).standard_normal((2, 16, 7, 6)).astype(np.float32)
    got = up.astype("bfloat16").run({"x": x})["y"]
    np.testing.assert_array_equal(got, up.set_precision("float32").run({"x": x})["y"])  # (its weights stay rounded)
