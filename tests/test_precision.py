"""bfloat16 inference (lamina.precision): the rounding kernel and the bfloat16 packed product on
every backend against numpy, and layers in bfloat16 against float32 within bounds derived from
the precision (the shipped language model's perplexity in each precision: test_quantize.py).

Bounds. Rounding to bfloat16 (8 significant bits, to nearest) moves a value by at most half a
unit in its last place, u = 2^-8 of itself, so a product of two rounded operands is within 2u + u² of the exact one,
and a dot product within (2u + u²)·Σ|a||b|. The bfloat16 products themselves are exact in
float32 (8 x 8 bits), so against float64 products of the rounded operands the only error left
is float32 accumulation: k·2^-24·Σ|a||b| for a depth of k."""

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
@pytest.mark.parametrize("m,k,n,alpha", [(1, 7, 5, 1.0), (64, 256, 1024, 1.0), (30, 100, 70, 0.5)])
def test_bfloat16_packed_product(backend, trans, m, k, n, alpha):
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


@pytest.mark.parametrize("kind", ["Linear", "RNN", "LSTM", "GRU"])
def test_layers_in_bfloat16_are_within_the_precision_of_float32(kind):
    """One step from a zero state: each gate pre-activation is x W_ihᵀ + b, within
    PRODUCT·(|x| |W_ih|ᵀ) of float32's; the cell passes it through functions whose slopes bound
    how far the output moves (RNN tanh: 1; LSTM: 1/4 + 1/4 + 1 over the o, i and g gates; GRU
    from h0 = 0: 1/4 (z) + 1 (n) + 1/4 |b_hn| (r))."""
    width, hidden = 96, 64
    make = {"Linear": lambda: lm.layers.Linear(width, hidden), "RNN": lambda: lm.layers.RNN(width, hidden),
            "LSTM": lambda: lm.layers.LSTM(width, hidden), "GRU": lambda: lm.layers.GRU(width, hidden)}[kind]
    f32, b16 = one_layer_network(make, width), one_layer_network(make, width).astype("bfloat16")
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


def test_the_bfloat16_network_uses_the_reference_semantics_everywhere():
    """The CPU's MKL bfloat16 products and the composed form on the core-only reference give the
    same layer outputs, up to float32 accumulation (a step apart, a rounding of h may flip)."""
    from lamina.testing import core_only
    width, hidden = 48, 32
    seqs = one_step_sequences(20, width, 2)
    cpu = one_layer_network(lambda: lm.layers.LSTM(width, hidden), width).astype("bfloat16")
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


def test_bfloat16_layers_agree_on_every_backend():
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
        want = one_layer_network(make, width).astype("bfloat16").run({"x": seqs})["y"].values
        for be in backends:
            got = one_layer_network(make, width).to(be).astype("bfloat16").run({"x": seqs})["y"].values
            np.testing.assert_allclose(got, want, rtol=0, atol=width * 2.0 ** -22, err_msg=str(be))
