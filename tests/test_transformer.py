"""Transformer layers over packed sequences: the attention and layer-norm kernels on every
backend against the reference, float64 gradient checks, and parity with PyTorch's
MultiheadAttention, LayerNorm, RMSNorm and TransformerEncoder(Layer), ragged and padded."""
import numpy as np
import pytest
import torch

import lamina as lm
from lamina.backends.reference import ReferenceBackend
from lamina.testing import add_probe_cost, check_gradients, probe_feed

from conftest import stable_rng as rng_for

REF = ReferenceBackend()
TOL = {np.float32: dict(rtol=2e-5, atol=2e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}
# lengths around the CPU kernel's block of 128 keys, and sequences of one row
LENGTHS = [[1], [5, 1, 3], [130, 2, 129], [300, 17]]


def offsets(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


# ---------------------------------------------------------------- kernels

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("lengths", LENGTHS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("heads,E", [(1, 8), (3, 21)])
@pytest.mark.parametrize("causal", [False, True])
def test_attention_kernels(backend, dtype, lengths, heads, E, causal):
    rng = rng_for("attention", tuple(lengths), heads, causal)
    starts = offsets(lengths)
    rows = int(starts[-1])
    qkv = rng.standard_normal((rows, 3 * E)).astype(dtype)
    out, lse = np.full((rows, E), np.nan, dtype), np.full((rows, heads), np.nan, dtype)
    want_out, want_lse = np.empty((rows, E)), np.empty((rows, heads))
    backend.attention(qkv, starts, heads, 0.4, causal, out, lse)
    REF.attention(qkv.astype(np.float64), starts, heads, 0.4, causal, want_out, want_lse)
    np.testing.assert_allclose(out, want_out, **TOL[dtype])
    np.testing.assert_allclose(lse, want_lse, **TOL[dtype])
    dout = rng.standard_normal((rows, E)).astype(dtype)
    dqkv, want = np.full((rows, 3 * E), np.nan, dtype), np.empty((rows, 3 * E))
    backend.attention_backward(qkv, out, lse, dout, starts, heads, 0.4, causal, dqkv)
    REF.attention_backward(qkv.astype(np.float64), want_out, want_lse, dout.astype(np.float64), starts, heads, 0.4,
                           causal, want)
    np.testing.assert_allclose(dqkv, want, **TOL[dtype])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("rows,C", [(1, 1), (7, 33), (65, 300)])
@pytest.mark.parametrize("center,affine", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("beta", [0.0, 1.0])
def test_layer_norm_kernels(backend, dtype, rows, C, center, affine, beta):
    rng = rng_for("layer norm", rows, C, center, affine, beta)
    x = (rng.standard_normal((rows, C)) * 3 + 1).astype(dtype)
    gamma, shift = (rng.standard_normal(C).astype(dtype) if affine else None for _ in range(2))
    results = []
    for be in (backend, REF):
        y, mean, rstd = np.full((rows, C), np.nan, dtype), np.empty(rows, dtype), np.empty(rows, dtype)
        be.layer_norm(x, gamma, shift, 1e-5, y, mean, rstd, center)
        dy = np.linspace(-1, 2, rows * C).reshape(rows, C).astype(dtype)
        dx, dgamma, dbeta = (np.full(shape, np.nan if beta == 0 else 1.0, dtype) for shape in ((rows, C), C, C))
        be.layer_norm_backward(x, dy, mean, rstd, gamma, dx, beta, dgamma if affine else None, beta,
                               dbeta if affine else None, beta, center)
        results.append([y, mean, rstd, dx] + ([dgamma, dbeta] if affine else []))
    for got, want in zip(*results):
        np.testing.assert_allclose(got, want, rtol=TOL[dtype]["rtol"] * 10, atol=TOL[dtype]["atol"] * 10)


def test_attention_kernels_refuse_mismatched_shapes(backend):
    qkv, out, lse = np.zeros((5, 12)), np.zeros((5, 4)), np.zeros((5, 2))
    starts = offsets([2, 3])
    with pytest.raises(ValueError, match="multiple of heads=3"):
        backend.attention(qkv, starts, 3, 1.0, False, out, lse)
    with pytest.raises(ValueError, match=r"lse must have shape \(5, 1\)"):
        backend.attention(qkv, starts, 1, 1.0, False, out, lse)
    with pytest.raises(lm.errors.IndexRangeError, match="starts must run from 0 to 5"):
        backend.attention(qkv, offsets([2, 2]), 2, 1.0, False, out, lse)


# ---------------------------------------------------------------- layers

def ragged(lengths, width, seed, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return lm.Sequences.from_list([rng.standard_normal((n, width)) for n in lengths], dtype=dtype)


def attention_net(E, heads, causal=False, per_sample=None):
    net = lm.Network()
    x = net.input("x", shape=(per_sample, E) if per_sample else (E,), sequence=not per_sample)
    net.outputs(y=lm.layers.MultiheadAttention(E, heads, causal=causal, name="attn")(x))
    return net


def gradients_check(net, feeds, batch, **kw):
    """A float64 gradient check of the output 'y' (through a probe cost) for the input 'x' and
    every parameter; returns the points checked."""
    probe = add_probe_cost(net, net.values[net.output_values["y"]])
    net.astype("float64")
    net.values["x"].requires_grad = True
    return check_gradients(net, {**feeds, probe: probe_feed(net, probe, batch)}, inputs=["x"], **kw)


@pytest.mark.parametrize("causal", [False, True])
def test_attention_gradients(causal):
    x = ragged([3, 1, 4], 6, seed=1)
    assert gradients_check(attention_net(6, 2, causal), {"x": x}, x) > 100


def test_attention_over_fixed_length_samples_equals_sequences():
    """[N, T, E] per-sample input: N sequences of T rows each, gradients included."""
    lm.manual_seed(2)
    fixed = attention_net(8, 2, per_sample=5)
    lm.manual_seed(2)
    packed = attention_net(8, 2)
    x = np.random.default_rng(3).standard_normal((3, 5, 8)).astype(np.float32)
    want = packed.run({"x": lm.Sequences.from_list(list(x))})["y"].values.reshape(3, 5, 8)
    np.testing.assert_allclose(fixed.run({"x": x})["y"], want, rtol=1e-6, atol=1e-6)
    assert gradients_check(fixed, {"x": x.astype(np.float64)}, 3) > 100


@pytest.mark.parametrize("kind", ["layer_norm", "layer_norm_no_bias", "rms_norm", "positional"])
def test_row_layer_gradients(kind):
    net = lm.Network()
    x = net.input("x", shape=(7,), sequence=True)
    make = {"layer_norm": lambda: lm.layers.LayerNorm(7), "layer_norm_no_bias": lambda: lm.layers.LayerNorm(7, bias=False),
            "rms_norm": lambda: lm.layers.RMSNorm(7, eps=1e-6), "positional": lambda: lm.layers.PositionalEmbedding(9, 7)}
    layer = make[kind]()
    net.outputs(y=layer(x))
    for p in layer.params.values():  # away from the initial ones and zeros
        p.assign(np.random.default_rng(4).standard_normal(p.shape).astype(np.float32))
    seqs = ragged([3, 1, 5], 7, seed=2)
    assert gradients_check(net, {"x": seqs}, seqs) > 20


def test_encoder_gradients():
    net = lm.Network()
    x = net.input("x", shape=(8,), sequence=True)
    h = lm.layers.TransformerEncoderLayer(8, 2, 12, dropout=0.0, activation="gelu", name="enc")(x)
    net.outputs(y=lm.layers.SequencePool("average")(h))
    assert gradients_check(net, {"x": ragged([2, 4, 1], 8, seed=3)}, 3, max_points=400) > 200


def test_positions_past_the_table_are_refused():
    net = lm.Network()
    x = net.input("x", shape=(4,), sequence=True)
    net.outputs(y=lm.layers.PositionalEmbedding(3, 4, name="pos")(x))
    with pytest.raises(lm.errors.InputError, match="pos.*a sequence of 4 rows is longer than num_positions=3"):
        net.run({"x": ragged([2, 4], 4, seed=0, dtype=np.float32)})
    with pytest.raises(lm.errors.GraphError, match="5 positions, more than num_positions=3"):
        other = lm.Network()
        other.outputs(y=lm.layers.PositionalEmbedding(3, 4)(other.input("x", shape=(5, 4))))


# ---------------------------------------------------------------- PyTorch parity

def padded(seqs):
    """A padded batch [N, T, E] and PyTorch's key padding mask (True where padding)."""
    longest = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), longest, seqs[0].shape[1]))
    for i, s in enumerate(seqs):
        batch[i, :len(s)] = s
    mask = np.arange(longest)[None, :] >= np.array([len(s) for s in seqs])[:, None]
    return torch.from_numpy(batch), torch.from_numpy(mask)


def copy_to_torch(net, module, prefix=""):
    """Every tensor of the module's state_dict from the network's parameter of the same name."""
    params = {p.name: p for p in net.parameters()}
    state = module.state_dict()
    assert sorted(prefix + k for k in state) == sorted(params), "parameter names differ from PyTorch's"
    with torch.no_grad():
        for k, v in state.items():
            v.copy_(torch.from_numpy(params[prefix + k].value.astype(np.float64)))


@pytest.mark.parametrize("causal", [False, True])
def test_attention_matches_pytorch_padded_and_ragged(causal):
    E, heads, lengths = 12, 3, [5, 1, 7, 3]
    net = attention_net(E, heads, causal)
    net.astype("float64")
    module = torch.nn.MultiheadAttention(E, heads, batch_first=True).double()
    copy_to_torch(net, module, "attn.")
    x = ragged(lengths, E, seed=5)
    got = net.run({"x": x})["y"].to_list()
    batch, mask = padded(x.to_list())
    longest = batch.shape[1]
    causal_mask = torch.triu(torch.ones(longest, longest, dtype=torch.bool), 1) if causal else None
    with torch.no_grad():
        want, _ = module(batch, batch, batch, key_padding_mask=mask, attn_mask=causal_mask, need_weights=False)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i], want[i, :n].numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("kind", ["LayerNorm", "RMSNorm"])
def test_norms_match_pytorch(kind):
    net = lm.Network()
    x = net.input("x", shape=(3, 10))
    layer = getattr(lm.layers, kind)((3, 10), name="norm")
    net.outputs(y=layer(x))
    net.astype("float64")
    for p in layer.params.values():
        p.assign(np.random.default_rng(6).standard_normal(p.shape))
    module = getattr(torch.nn, kind)((3, 10)).double()
    copy_to_torch(net, module, "norm.")
    data = np.random.default_rng(7).standard_normal((4, 3, 10)) * 5 + 2
    with torch.no_grad():
        want = module(torch.from_numpy(data)).numpy()
    np.testing.assert_allclose(net.run({"x": data})["y"], want, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_encoder_matches_pytorch_padded_and_ragged(norm_first, activation):
    """A 2-layer TransformerEncoder with a final norm: PyTorch on the padded batch with its key
    padding mask, lamina on the ragged batch; outputs and every parameter's gradient."""
    d, heads, ff, lengths = 16, 4, 24, [6, 2, 9]
    net = lm.Network()
    x = net.input("x", shape=(d,), sequence=True)
    layer = lm.layers.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation=activation, norm_first=norm_first)
    h = lm.layers.TransformerEncoder(layer, 2, norm_eps=1e-5, name="enc")(x)
    net.outputs(y=h, loss=lm.layers.SquareError()(lm.layers.SequencePool("sum")(h), net.input("t", shape=(d,))))
    net.astype("float64")
    torch_layer = torch.nn.TransformerEncoderLayer(d, heads, ff, dropout=0.0, activation=activation,
                                                   norm_first=norm_first, batch_first=True)
    module = torch.nn.TransformerEncoder(torch_layer, 2, norm=torch.nn.LayerNorm(d),
                                         enable_nested_tensor=False).double()
    copy_to_torch(net, module, "enc.")
    seqs = ragged(lengths, d, seed=8)
    target = np.random.default_rng(9).standard_normal((len(lengths), d))
    feeds = {"x": seqs, "t": target}
    got = net.run(feeds)["y"].to_list()
    batch, mask = padded(seqs.to_list())
    want = module(batch, src_key_padding_mask=mask)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(got[i], want[i, :n].detach().numpy(), rtol=1e-9, atol=1e-11)
    # the same cost in PyTorch (SquareError: the summed squares, averaged over the batch)
    pooled = (want * (~mask)[..., None]).sum(dim=1)
    loss = ((pooled - torch.from_numpy(target)) ** 2).sum() / len(lengths)
    loss.backward()
    net.forward(feeds, outputs=["loss"])
    np.testing.assert_allclose(net.backward(), loss.item(), rtol=1e-10)
    params = {p.name: p for p in net.parameters()}
    for k, v in module.named_parameters():
        np.testing.assert_allclose(params["enc." + k].dense_grad(net.backend), v.grad.numpy(), rtol=1e-8, atol=1e-10,
                                   err_msg=k)


def test_encoder_classifier_trains_and_round_trips(tmp_path):
    """A small encoder classifier (token and position embeddings, 2 layers, mean pooling) learns
    a task that needs attention (is the first token repeated later?), and saves and loads."""
    rng = np.random.default_rng(10)
    lm.manual_seed(11)
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    label = net.input("label", dtype="int32")
    h = lm.layers.Embedding(6, 16)(ids)
    h = lm.layers.LayerNorm(16)(lm.layers.PositionalEmbedding(12, 16)(h))
    h = lm.layers.TransformerEncoder(lm.layers.TransformerEncoderLayer(16, 2, 32, dropout=0.0), 2, name="enc")(h)
    logits = lm.layers.Linear(16, 2)(lm.layers.SequencePool("first")(h))
    net.outputs(logits=logits, loss=lm.layers.SoftmaxCrossEntropy()(logits, label))

    def batch(n=32):
        seqs = [rng.integers(0, 6, rng.integers(2, 10)).astype(np.int32) for _ in range(n)]
        labels = np.array([int(s[0] in s[1:]) for s in seqs], np.int32)
        return {"ids": lm.Sequences.from_list(seqs), "label": labels}

    opt = lm.optim.Adam(net.parameters(), lr=3e-3)
    test = batch(256)
    before = (net.run(test)["logits"].argmax(1) == test["label"]).mean()
    for _ in range(150):
        net.train_step(batch(), opt)
    after = (net.run(test)["logits"].argmax(1) == test["label"]).mean()
    assert after > max(0.85, before + 0.2), (before, after)
    lm.save(net, tmp_path / "encoder.lamina")
    again = lm.load(tmp_path / "encoder.lamina")
    np.testing.assert_array_equal(again.run(test)["logits"], net.run(test)["logits"])


# ---------------------------------------------------------------- ONNX

@pytest.mark.parametrize("pool", ["average", "first", "last", "max", "sum"])
@pytest.mark.parametrize("causal", [False, True])
def test_encoder_exports_to_onnx_runtime(tmp_path, pool, causal):
    """An encoder classifier exported with lamina.onnx.save runs in ONNX Runtime on the padded
    batch (ids [N, T] and lengths) and gives lamina's outputs on the ragged one."""
    import onnxruntime as ort
    lm.manual_seed(13)
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    h = lm.layers.LayerNorm(16)(lm.layers.PositionalEmbedding(12, 16)(lm.layers.Embedding(20, 16)(ids)))
    h = lm.layers.TransformerEncoderLayer(16, 4, 24, activation="gelu", norm_first=causal, causal=causal)(h)
    net.outputs(y=lm.layers.Linear(16, 3)(lm.layers.SequencePool(pool)(h)))
    rng = np.random.default_rng(14)
    seqs = [rng.integers(0, 20, n).astype(np.int32) for n in (5, 1, 9, 3)]
    want = net.run({"ids": lm.Sequences.from_list(seqs)})["y"]
    lm.onnx.save(net, tmp_path / "encoder.onnx")
    padded = np.zeros((4, 9), np.int64)
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    session = ort.InferenceSession(str(tmp_path / "encoder.onnx"), providers=["CPUExecutionProvider"])
    got = session.run(["y"], {"ids": padded, "lengths": np.array([len(s) for s in seqs], np.int64)})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_norms_round_trip_through_onnx(tmp_path):
    """LayerNorm and RMSNorm export as LayerNormalization and RMSNormalization, run in ONNX
    Runtime, and import back as the same layers."""
    import onnxruntime as ort
    net = lm.Network()
    x = net.input("x", shape=(3, 8))
    a, b = lm.layers.LayerNorm(8, eps=1e-6), lm.layers.RMSNorm((3, 8), eps=1e-5)
    net.outputs(y=b(a(x)))
    for p in net.parameters():
        p.assign(np.random.default_rng(15).standard_normal(p.shape).astype(np.float32))
    data = np.random.default_rng(16).standard_normal((5, 3, 8)).astype(np.float32)
    want = net.run({"x": data})["y"]
    lm.onnx.save(net, tmp_path / "norms.onnx")
    session = ort.InferenceSession(str(tmp_path / "norms.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(session.run(["y"], {"x": data})[0], want, rtol=1e-5, atol=1e-5)
    again = lm.onnx.load(tmp_path / "norms.onnx")
    assert sorted(type(n.layer).__name__ for n in again.scheduler.order) == ["LayerNorm", "RMSNorm"]
    np.testing.assert_allclose(again.run({"x": data})["y"], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("precision", ["bfloat16", "int8"])
def test_encoder_runs_in_reduced_precision(precision):
    """The projections and feed-forward products of an encoder in bfloat16 or int8 (the
    attention and normalization stay float32): close to float32, and not equal to it."""
    lm.manual_seed(17)
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    h = lm.layers.LayerNorm(32)(lm.layers.PositionalEmbedding(40, 32)(lm.layers.Embedding(50, 32)(ids)))
    h = lm.layers.TransformerEncoder(lm.layers.TransformerEncoderLayer(32, 4, 64, dropout=0.0), 2)(h)
    net.outputs(y=lm.layers.SequencePool("average")(h))
    rng = np.random.default_rng(18)
    feeds = {"ids": lm.Sequences.from_list([rng.integers(0, 50, n).astype(np.int32) for n in (7, 30, 2, 15)])}
    want = net.run(feeds)["y"]
    low = lm.quantize(net) if precision == "int8" else net.set_precision(precision)
    got = low.run(feeds)["y"]
    error = np.abs(got - want).max() / np.abs(want).max()
    assert 1e-5 < error < 3e-2, error
