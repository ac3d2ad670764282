"""int8 dynamic quantization (lamina.precision, lm.quantize): the row quantization kernel and the
int8 packed product on every backend against numpy, layers in int8 against float32 within bounds
derived from the quantization, the model file's int8 and bfloat16 tensors, the non-VNNI path
(127 activation steps) forced through MKL, and the shipped language model's perplexity.

Bounds. A value quantized in steps of s is within s/2 of itself (round to nearest; the range of
a row, or a weight channel's magnitude, is inside the grid, so nothing is clipped). With
a = s_a q_a + e_a and w = s_w q_w + e_w, |e_a| <= s_a/2 and |e_w| <= s_w/2, a dot product over k
moves by at most Σ_k (s_a/2 |w_k| + s_w/2 |a_k| + s_a s_w / 4). The integer sums are exact (int32
in MKL; float32 while below 2^24 in the composed form), so against numpy's float64 product of the
same integers only float32 rounding is left: a few units in the last place of the result, and
k·2^-24 of Σ|q_a||q_w|·s_a·s_w where the sums leave float32's exact integers."""
from pathlib import Path

import numpy as np
import pytest

import lamina as lm
from conftest import LOW_PRECISION_PATHS
from helpers import one_layer_network, one_step_sequences
from lamina.backends.reference import ReferenceBackend
from lamina.precision import (ACTIVATION_LEVELS, WEIGHT_LEVELS, dequantize_weight, quantize_rows, quantize_weight,
                              round_bfloat16)

EPS = 2.0 ** -24


def quantization_bound(a, w, levels=ACTIVATION_LEVELS):
    """Σ_k (s_a/2 |w_jk| + s_w/2 |a_ik| + s_a s_w / 4) for each (row i of a, row j of w)."""
    _, sa = quantize_rows(a, levels)
    _, sw = quantize_rows(w, WEIGHT_LEVELS, symmetric=True)
    k = a.shape[1]
    return (sa[:, None] / 2 * np.abs(w).sum(1)[None, :] + sw[None, :] / 2 * np.abs(a).sum(1)[:, None]
            + k * sa[:, None] * sw[None, :] / 4)


def test_the_numpy_definition_quantizes_within_half_a_step():
    rng = np.random.default_rng(0)
    x = (rng.standard_normal((50, 200)) * 10.0 ** rng.integers(-3, 3, (50, 1))).astype(np.float32)
    x[1] = np.abs(x[1])  # all positive: the range is [0, max], zero point 0
    x[2] = -np.abs(x[2])  # all negative: zero point 255
    x[3] = 0  # all zero: scale 0
    for levels, symmetric in ((255, False), (127, False), (127, True)):
        q, s = quantize_rows(x, levels, symmetric)
        assert np.array_equal(q, np.rint(q)) and s[3] == 0 and not q[3].any()
        assert np.all(np.abs(q * s[:, None] - x) <= s[:, None] / 2 * (1 + 1e-6))
        span = q.max(1) - q.min(1)
        assert np.all(span[np.arange(50) != 3] >= levels - 1)  # the grid is used in full
        if symmetric:
            assert np.abs(q).max() == levels
        else:
            assert q[1].min() == 0 and q[2].max() == 0 and span.max() <= levels


def test_the_low_precision_products_follow_the_cpu_vendor_unless_forced(monkeypatch):
    """lamina's own products where they run on AMX tiles; else MKL's bfloat16 and int8 GEMMs on
    Intel CPUs, lamina's own products elsewhere (where MKL's ran slower than float32) where its int8
    kernel runs vector code (AVX2; else float32 products); LAMINA_LOW_PRECISION forces any, and a
    wrong name is refused with the choices."""
    from lamina.backends.cpu import blas, compiled
    from lamina.backends.cpu.compiled import _kernels
    from lamina.errors import SettingError
    monkeypatch.delenv("LAMINA_LOW_PRECISION", raising=False)
    own = "lamina" if _kernels.int8_uses_avx2() else "float32"
    intel = "lamina" if compiled.PATH == "amx" else "mkl" if blas.built("mkl") else own
    for vendor, path in (("GenuineIntel", intel), ("AuthenticAMD", "lamina" if compiled.PATH == "amx" else own)):
        monkeypatch.setattr(blas, "cpu_vendor", lambda vendor=vendor: vendor)
        assert blas.low_precision_products() == path
        assert lm.CPUBackend().low_precision == path
    monkeypatch.setattr(blas, "cpu_vendor", lambda: "GenuineIntel")
    for forced in ("float32", "lamina"):
        monkeypatch.setenv("LAMINA_LOW_PRECISION", forced)
        assert lm.CPUBackend().low_precision == forced
    if blas.built("mkl"):  # the backend's own argument over the environment
        assert lm.CPUBackend(low_precision="mkl").low_precision == "mkl"
    monkeypatch.setenv("LAMINA_LOW_PRECISION", "fp8")
    with pytest.raises(SettingError, match=r"LAMINA_LOW_PRECISION: expected one of 'mkl', 'lamina', 'float32', "
                                           r"found 'fp8'"):
        lm.CPUBackend()
    with pytest.raises(SettingError, match=r"low_precision=.*found 'int4'"):
        lm.CPUBackend(low_precision="int4")


def test_float32_products_compute_int8_from_the_snapped_activations():
    """The float32 path's left operand: each row on its u8 grid (numpy's integers times the
    row's scale, to float32 rounding), a NaN row all NaN."""
    rng = np.random.default_rng(3)
    a = (rng.standard_normal((9, 301)) * 4).astype(np.float32)
    a[3] = 0
    a[5, 7] = np.nan
    be = lm.CPUBackend(low_precision="float32")
    got = be.reduced_operand(a, "int8")
    q, s = quantize_rows(a, ACTIVATION_LEVELS)
    keep = np.arange(9) != 5
    np.testing.assert_allclose(got[keep], (q * s[:, None])[keep], rtol=2 ** -23, atol=0)
    assert np.isnan(got[5]).all() and not got[3].any()
    np.testing.assert_array_equal(be.reduced_operand(a, "bfloat16")[keep], round_bfloat16(a)[keep])


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("m,k", [(1, 1), (7, 300), (600, 513)])
def test_quantize_rows_kernel(backend, m, k, symmetric):
    rng = np.random.default_rng(m + k)
    x = (rng.standard_normal((m, k)) * 3).astype(np.float32)
    x[m // 2] = 0
    q, s = np.empty_like(x), np.empty(m, np.float32)
    backend.quantize_rows(x, q, s, 127 if symmetric else 255, symmetric)
    want_q, want_s = quantize_rows(x, 127 if symmetric else 255, symmetric)
    np.testing.assert_array_equal(s, want_s)
    np.testing.assert_array_equal(q, want_q)


# (600 rows: more than a pack serves, the plain GEMM of the reduced values where float32 products serve)
@pytest.mark.parametrize("m,k,n,alpha", [(1, 7, 5, 1.0), (64, 256, 1024, 1.0), (30, 700, 70, 0.5), (600, 130, 40, 1.0)])
def test_int8_packed_product(reduced_backend, m, k, n, alpha):
    backend = reduced_backend
    rng = np.random.default_rng(m + k + n)
    a = rng.standard_normal((m, k)).astype(np.float32)
    a[:, :3] += 2.0  # rows whose range is not centred on 0
    w = rng.standard_normal((n, k)).astype(np.float32)
    bias = rng.standard_normal(n).astype(np.float32)
    levels = getattr(backend, "int8_activation_levels", ACTIVATION_LEVELS)
    qa, sa = quantize_rows(a, levels)
    qw, sw = quantize_rows(w, WEIGHT_LEVELS, symmetric=True)
    sums = qa.astype(np.float64) @ qw.T.astype(np.float64)
    exact = alpha * sums * sa[:, None] * sw[None, :]
    scale = np.abs(alpha) * sa[:, None] * sw[None, :]
    rounding = 8 * EPS * np.abs(exact) + k * EPS * scale * (np.abs(qa) @ np.abs(qw).T) + 1e-30
    packed = backend.pack(w, True, alpha, m, precision="int8")
    c = np.full((m, n), 7.0, np.float32)
    backend.packed_gemm(a, packed, c, beta=1.0)
    assert np.all(np.abs(c - (exact + 7.0)) <= rounding + 16 * EPS * 7.0)
    backend.packed_gemm_bias(a, packed, c, bias)
    assert np.all(np.abs(c - (exact + bias)) <= rounding + 16 * EPS * np.abs(bias))
    # within the quantization bound of the float32 product, and not the float32 product itself
    full = alpha * (a.astype(np.float64) @ w.T.astype(np.float64))
    assert np.all(np.abs(c - (full + bias)) <= abs(alpha) * quantization_bound(a, w, levels) + 1e-5)
    if k >= 100:  # further from float32's than a float32 product's rounding could take it
        assert np.abs(c - (full + bias)).max() > (k * EPS * np.abs(alpha) * (np.abs(a) @ np.abs(w).T)).max()


def test_a_row_with_nan_or_infinity_gives_nan_not_a_number_that_looks_right(reduced_backend):
    backend = reduced_backend
    rng = np.random.default_rng(5)
    a = rng.standard_normal((4, 40)).astype(np.float32)
    a[1, 7], a[2, 39] = np.nan, np.inf
    q, s = np.empty_like(a), np.empty(4, np.float32)
    backend.quantize_rows(a, q, s, ACTIVATION_LEVELS)
    assert list(np.isnan(s)) == [False, True, True, False]
    c = np.empty((4, 6), np.float32)
    backend.packed_gemm(a, backend.pack(rng.standard_normal((6, 40)).astype(np.float32), True, 1.0, 4, "int8"), c)
    assert np.isnan(c[1:3]).all() and np.isfinite(c[[0, 3]]).all()


def test_the_int8_panels_run_the_widest_kernel_of_the_build_and_the_cpu():
    """VNNI (vpdpbusd) in the AVX-512 build on a CPU with AVX512-VNNI and AVX512-VL, else AVX2
    where the CPU has it (LAMINA_ISA=avx2 runs the AVX2 kernel there, and the kernel tests run on
    it: the same exact sums), else the portable kernel; `lamina devices` names the one taken."""
    import subprocess
    import sys
    from lamina.backends.cpu import compiled
    from lamina.processor import instruction_sets
    sets = set(instruction_sets())
    vnni = compiled.PATH in ("amx", "avx512") and {"avx512_vnni", "avx512vl"} <= sets
    assert compiled._kernels.int8_uses_vnni() == vnni
    assert compiled._kernels.int8_uses_avx2() == (compiled.PATH != "baseline" and "avx2" in sets)
    assert compiled._kernels.amx_runs() == (compiled.PATH == "amx")
    if lm.CPUBackend().low_precision == "lamina":
        out = subprocess.run([sys.executable, "-m", "lamina.cli", "devices"], capture_output=True, text=True)
        kernel = "AMX tiles" if compiled.PATH == "amx" else "AVX-512 VNNI" if vnni else "AVX2"
        assert f"int8 products: lamina's u8 x s8 panels, {kernel} (activations in 127 steps)" in out.stdout, out.stdout


@pytest.mark.parametrize("k", [1, 4, 255, 4099])
def test_lamina_int8_panels_sum_the_largest_products_exactly(k):
    """lamina's int8 kernel sums u8 x s8 pairs in int16 (AVX2's vpmaddubsw): activations at the top
    of their 127 steps times weights at ±127, every pair's sum the largest, and rows of mixed
    signs (zero points inside the grid), give numpy's integers exactly, at every depth's tail of
    a quad and every tail of a 16-channel panel; the sums are then in float32 only."""
    be = lm.CPUBackend(low_precision="lamina")
    rng = np.random.default_rng(k)
    n = 37
    for m in (11, 8):  # every tile of rows: 6 (VNNI) or 4 (AVX2), then 4, 2 and 1
        a = np.full((m, k), 3.0, np.float32)
        a[1::2] = rng.standard_normal((m // 2, k))  # (the others on their grids' top step: [0, 3] in 127 steps)
        w = np.where(rng.random((n, k)) < 0.5, -1.0, 1.0).astype(np.float32)
        w[3] = rng.standard_normal(k)
        packed = be.pack(w, True, 1.0, m, precision="int8")
        c = np.empty((m, n), np.float32)
        be.packed_gemm(a, packed, c)
        qa, sa = quantize_rows(a, be.int8_activation_levels)
        qw, sw = quantize_rows(w, WEIGHT_LEVELS, symmetric=True)
        assert be.int8_activation_levels == 127 and qa[0].min() == 127 and np.abs(qw[0]).min() == 127
        exact = (qa.astype(np.float64) @ qw.T.astype(np.float64)) * sa[:, None] * sw[None, :]
        np.testing.assert_allclose(c, exact, rtol=4 * EPS,
                                   atol=k * EPS * (sa[:, None] * sw[None, :] * 127 * 127).max(), err_msg=str(m))
    with pytest.raises(ValueError, match="int8 products sum exactly in int32 to a depth of"):
        be.pack(np.ones((2, 70000), np.float32), True, 1.0, 1, precision="int8")


def test_an_int8_pack_takes_the_weight_as_rows(backend):
    w = np.ones((4, 3), np.float32)
    with pytest.raises(ValueError, match="per output channel"):
        backend.pack(w, False, 1.0, 2, precision="int8")
    with pytest.raises(TypeError, match="float32 weights"):
        backend.pack(w.astype(np.float64), True, 1.0, 2, precision="int8")


LAYERS = {"Linear": lambda w, h: lm.layers.Linear(w, h), "RNN": lambda w, h: lm.layers.RNN(w, h),
          "LSTM": lambda w, h: lm.layers.LSTM(w, h), "GRU": lambda w, h: lm.layers.GRU(w, h)}


@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_layers_in_int8_are_within_the_quantization_of_float32(kind, low_precision):
    """One step from a zero state: each gate pre-activation x W_ihᵀ + b is within the
    quantization bound of float32's; the cell's slopes bound how far the output moves (as for
    bfloat16: RNN 1, LSTM 1.5, GRU 1.25 + |b_hn|/4)."""
    width, hidden = 96, 64
    f32 = one_layer_network(lambda: LAYERS[kind](width, hidden), width)
    q8 = lm.quantize(one_layer_network(lambda: LAYERS[kind](width, hidden), width, low_precision))
    assert q8.precision == "int8"
    seqs = one_step_sequences(40, width, 1)
    want, got = (net.run({"x": seqs})["y"].values for net in (f32, q8))
    layer = f32.layers[0]
    w = layer.params["weight" if kind == "Linear" else "weight_ih_l0"].value
    levels = lm.CPUBackend(low_precision=low_precision).int8_activation_levels
    gates = quantization_bound(seqs.values, w, levels).reshape(len(seqs.values), -1, hidden).max(axis=1)
    if kind == "GRU":
        slope = 1.25 + 0.25 * np.abs(layer.params["bias_hh_l0"].value[2 * hidden:]).max()
    else:
        slope = {"Linear": 1.0, "RNN": 1.0, "LSTM": 1.5}[kind]
    assert np.all(np.abs(got - want) <= slope * gates + 1e-6)
    assert np.abs(got - want).max() > 1e-4  # the products did run in int8


def test_quantize_rounds_the_product_weights_to_their_int8_values():
    net = one_layer_network(lambda: lm.layers.LSTM(16, 8, num_layers=2), 16)
    before = {k: p.value.copy() for k, p in net.layers[0].params.items()}
    lm.quantize(net)
    for k, p in net.layers[0].params.items():
        if k.startswith("weight"):
            q, s = quantize_weight(before[k])
            np.testing.assert_allclose(p.value, dequantize_weight(q, s), rtol=1e-6, atol=0)
            assert np.all(np.abs(p.value - before[k]) <= s[:, None] / 2 * (1 + 1e-6))
        else:  # biases stay float32
            np.testing.assert_array_equal(p.value, before[k])


# (lamina's int8 panels quantize activations in 127 steps, the other backends in 255)
@pytest.mark.parametrize("low_precision", [path for path in LOW_PRECISION_PATHS if path != "lamina"])
def test_int8_agrees_on_every_backend(low_precision):
    """An int8 LSTM and Linear on each device backend (and the core-only reference) against the
    CPU's, one step from a zero state: the same integers everywhere (where the CPU sums 255
    activation steps exactly), so only float32 rounding differs."""
    from conftest import OPENCL_DEVICES
    from lamina.testing import core_only
    backends = [core_only(ReferenceBackend)()]
    if OPENCL_DEVICES:
        from lamina.backends.opencl import OpenCLBackend
        backends += [OpenCLBackend(i) for i in range(len(OPENCL_DEVICES))]
    if lm.CPUBackend(low_precision=low_precision).int8_activation_levels != ACTIVATION_LEVELS:
        pytest.skip("this CPU's int8 products sum 127 activation steps (no VNNI): the other test covers it")
    width, hidden = 64, 48
    seqs = one_step_sequences(24, width, 3)
    for make in (lambda: lm.layers.LSTM(width, hidden), lambda: lm.layers.Linear(width, hidden)):
        want = lm.quantize(one_layer_network(make, width, low_precision)).run({"x": seqs})["y"].values
        for be in backends:
            got = lm.quantize(one_layer_network(make, width).to(be)).run({"x": seqs})["y"].values
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6, err_msg=str(be))


def test_the_path_without_an_int8_dot_product_sums_127_steps(tmp_path):
    """MKL limited to AVX2 sums u8 x s8 pairs in int16, which saturates at 255 x 127 x 2: the
    backend finds that out and quantizes activations in 127 steps, and the product stays exact
    (MKL_ENABLE_INSTRUCTIONS forces its AVX2 path on every machine; on an Intel CPU that path
    saturates, so 127 steps there; MKL's path for other vendors' CPUs sums exactly, and whatever
    the probe finds, the product is exact)."""
    from lamina.processor import vendor
    import subprocess
    import sys
    script = tmp_path / "probe.py"
    script.write_text(
        "import numpy as np, lamina as lm\n"
        "from lamina.precision import quantize_rows, WEIGHT_LEVELS\n"
        "be = lm.CPUBackend()\n"
        "rng = np.random.default_rng(0)\n"
        "a = np.abs(rng.standard_normal((9, 300))).astype(np.float32); w = rng.standard_normal((20, 300)).astype(np.float32)\n"
        "a[:, 0] = 9.0; w[:, 0] = 5.0  # steps at the top of both grids: the pairs that would saturate\n"
        "c = np.empty((9, 20), np.float32)\n"
        "be.packed_gemm(a, be.pack(w, True, 1.0, 9, 'int8'), c)\n"
        "qa, sa = quantize_rows(a, be.int8_activation_levels); qw, sw = quantize_rows(w, WEIGHT_LEVELS, True)\n"
        "want = (qa.astype(np.float64) @ qw.T) * sa[:, None] * sw\n"
        "print(be.int8_activation_levels, float(np.abs(c - want).max() / np.abs(want).max()))\n")
    intel = vendor() == "GenuineIntel"
    for isa, levels in (("AVX2", 127 if intel else None), (None, lm.CPUBackend().int8_activation_levels)):
        env = {k: v for k, v in __import__("os").environ.items() if k != "MKL_ENABLE_INSTRUCTIONS"}
        if isa:
            env["MKL_ENABLE_INSTRUCTIONS"] = isa
        out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, check=True)
        found, error = out.stdout.split()
        allowed = (levels,) if levels else (127, 255)
        assert int(found) in allowed and float(error) < 1e-6, out.stdout


@pytest.mark.parametrize("precision,stored", [("int8", "I8"), ("bfloat16", "BF16")])
def test_the_model_file_stores_the_weights_in_the_precision(tmp_path, precision, stored):
    net = one_layer_network(lambda: lm.layers.LSTM(16, 8), 16).set_precision(precision)
    seqs = one_step_sequences(5, 16, 0)
    lm.save(net, tmp_path / "m.lamina")
    back = lm.load(tmp_path / "m.lamina")
    assert back.precision == precision
    for (k, p), q in zip(net.layers[0].params.items(), back.layers[0].params.values()):
        np.testing.assert_array_equal(q.value, p.value, err_msg=k)
    np.testing.assert_array_equal(back.run({"x": seqs})["y"].values, net.run({"x": seqs})["y"].values)
    import json
    blob = (tmp_path / "m.lamina").read_bytes()
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    assert {header[k]["dtype"] for k in header if k.startswith("lstm") and ".weight" in k} == {stored}
    assert {header[k]["dtype"] for k in header if k.startswith("lstm") and ".bias" in k} == {"F32"}
    # other safetensors readers see the same numbers
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file
    tensors = load_file(tmp_path / "m.lamina")
    key = next(k for k in tensors if k.endswith("weight_ih_l0") and not k.startswith("scale/"))
    value = tensors[key].float()
    if precision == "int8":
        value = value * tensors["scale/" + key][:, None]
    np.testing.assert_allclose(value.numpy(), net.layers[0].params["weight_ih_l0"].value, rtol=1e-6)


def test_a_damaged_int8_file_is_refused(tmp_path):
    from lamina.io.model import _read, _serialize, digest
    net = lm.quantize(one_layer_network(lambda: lm.layers.Linear(8, 4), 8))
    lm.save(net, tmp_path / "m.lamina")
    metadata, tensors = _read(tmp_path / "m.lamina")
    key = next(k for k in tensors if k.startswith("scale/"))
    for change, message in ((lambda t: t.pop(key), "needs its scales"),
                            (lambda t: t.__setitem__(key, -t[key]), "finite scales of at least 0"),
                            (lambda t: t.__setitem__(key, t[key][:-1]), "needs its scales")):
        damaged = dict(tensors)
        change(damaged)
        meta = dict(metadata)
        meta["digest"] = digest(damaged, meta)
        (tmp_path / "d.lamina").write_bytes(_serialize(damaged, meta))
        with pytest.raises(lm.ModelFileError, match=message):
            lm.load(tmp_path / "d.lamina")


@pytest.mark.parametrize("precision,within", [("bfloat16", 0.01), ("int8", 0.02)])
def test_the_language_model_perplexity_in_reduced_precision(precision, within):
    """The shipped language model's held-out perplexity: within 1% of float32 in bfloat16, 2% in int8."""
    from lamina.zoo import language
    path = Path(__file__).resolve().parent.parent / "models/python_lm/model.lamina"
    f32, reduced = lm.load(path), lm.load(path).set_precision(precision)
    _, held = language.stdlib_split()
    tok = language.tokenizer(f32)
    ids = np.concatenate([tok.encode(t) for t in language.read_texts(held[:12])])
    chunks = language.chunk(ids, 48)
    p32, p = language.perplexity(f32, chunks), language.perplexity(reduced, chunks)
    assert p != p32 and abs(p / p32 - 1) < within, (p32, p)


def test_bfloat16_rounds_the_product_weights():
    net = one_layer_network(lambda: lm.layers.Linear(16, 8), 16)
    w = net.layers[0].params["weight"].value.copy()
    net.astype("bfloat16")
    np.testing.assert_array_equal(net.layers[0].params["weight"].value, round_bfloat16(w))
    assert not np.any(net.layers[0].params["weight"].value.view(np.uint32) & 0xFFFF)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN", "RNN-relu"])
def test_the_compiled_reduced_recurrence_equals_the_step_by_step_one(monkeypatch, kind, precision, low_precision):
    """The CPU's whole-direction loop against the layer's steps one at a time, on a ragged batch
    through two bidirectional layers with initial states: the same products of the same
    operands, so equal but for the order of float32 sums. With MKL's products the loop is
    fused_recurrence.reduced_forward; with float32 products (on lamina's panels) the fused
    recurrence reducing the states before each product, and with lamina's int8 panels the fused
    recurrence multiplying them in int8, each on one thread and shared by sequences and by
    units."""
    from lamina.backends.cpu import fused_recurrence
    rng = np.random.default_rng(7)
    lm.manual_seed(2)
    # (48 units: three panels, so two threads can share them by units)
    make = {"LSTM": lambda: lm.layers.LSTM(24, 48, num_layers=2, bidirectional=True),
            "GRU": lambda: lm.layers.GRU(24, 48, num_layers=2, bidirectional=True),
            "RNN": lambda: lm.layers.RNN(24, 48, num_layers=2, bidirectional=True),
            "RNN-relu": lambda: lm.layers.RNN(24, 48, num_layers=2, bidirectional=True, nonlinearity="relu")}[kind]
    net = lm.Network()
    x, h0 = net.input("x", 24, sequence=True), net.input("h0", [4, 48])
    layer = make()
    net.outputs(y=layer(x, h0)[0])
    net.to(lm.CPUBackend("openblas" if low_precision != "mkl" else None, low_precision))
    net.set_precision(precision)
    lengths = (7, 1, 12, 5, 12, 3, 9, 4, 12)  # (enough sequences for two threads to share them)
    seqs = lm.Sequences.from_list([rng.standard_normal((n, 24)).astype(np.float32) for n in lengths])
    feeds = {"x": seqs, "h0": rng.standard_normal((len(lengths), 4, 48)).astype(np.float32)}
    loop = "reduced_forward" if low_precision == "mkl" else "forward"
    original, calls = getattr(fused_recurrence, loop), []
    monkeypatch.setattr(fused_recurrence, loop, lambda *a: calls.append(1) or original(*a))
    shares = ("auto",) if low_precision == "mkl" else ("auto", "rows", "units")
    teams, share_of = [], fused_recurrence._share
    monkeypatch.setattr(fused_recurrence, "_share", lambda *a: teams.append(share_of(*a)) or teams[-1])
    fused = []
    for share in shares:
        monkeypatch.setattr(fused_recurrence, "FUSED_SHARE", share)
        monkeypatch.setattr(fused_recurrence, "FUSED_PARALLEL_MIN", 0 if share != "auto" else 1 << 24)
        fused.append(net.run(feeds)["y"].values)
    assert len(calls) == 4 * len(shares)  # two layers, two directions
    if low_precision != "mkl" and lm.get_num_threads() > 1:  # shared by sequences, and by units
        assert {by_rows for threads, by_rows in teams if threads > 1} == {True, False}
    monkeypatch.setattr(fused_recurrence, "fuses_reduced", lambda *a: False)
    monkeypatch.setattr(fused_recurrence, "fuses_in", lambda *a: False)
    stepwise = net.run(feeds)["y"].values
    for got in fused:
        np.testing.assert_allclose(got, stepwise, rtol=0, atol=1e-6)


def test_a_checkpoint_of_a_quantized_network_resumes_exactly(tmp_path):
    """Training moves an int8 network's weights off the int8 grid: its checkpoint keeps them as
    float32, so resuming continues from the same values; its model file stores int8."""
    net = lm.quantize(one_layer_network(lambda: lm.layers.Linear(16, 4), 16))
    t = net.input("t", 4, sequence=True)
    net.outputs(loss=lm.layers.SquareError()(net.values[net.output_values["y"]], t))
    opt = lm.optim.Adam(net, lr=1e-2)
    feeds = {"x": one_step_sequences(8, 16, 1), "t": one_step_sequences(8, 4, 2)}
    for _ in range(3):
        net.train_step(feeds, opt)
    w = net.layers[0].params["weight"].value.copy()
    assert not np.allclose(w, dequantize_weight(*quantize_weight(w)), rtol=0, atol=1e-7)  # off the grid
    lm.save_checkpoint(tmp_path / "ck.lamina", net, opt)
    ck = lm.load_checkpoint(tmp_path / "ck.lamina")
    assert ck.net.precision == "int8"
    np.testing.assert_array_equal(ck.net.layers[0].params["weight"].value, w)
    lm.save(net, tmp_path / "m.lamina")
    np.testing.assert_array_equal(lm.load(tmp_path / "m.lamina").layers[0].params["weight"].value,
                                  dequantize_weight(*quantize_weight(w)))
