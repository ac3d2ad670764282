"""Recurrent layers: a plain numpy per-sequence reference (a Python loop over time, no batching),
float64 gradient checks for every option, packed and plain GEMM paths, the pack following the
weights, and PyTorch parity where PyTorch is importable."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import GRU, LSTM, RNN
from lamina.backends.cpu import CPUBackend
from lamina.testing import add_probe_cost, check_gradients, probe_feed

from conftest import BLAS_PROVIDERS

LAYERS = {"rnn": RNN, "rnn_relu": RNN, "lstm": LSTM, "gru": GRU, "gru_reset_first": GRU}


def make(kind, **kw):
    if kind == "rnn_relu":
        kw["nonlinearity"] = "relu"
    if kind == "gru_reset_first":
        kw["linear_before_reset"] = False
    return LAYERS[kind](**kw)


# ---------------------------------------------------------------- the numpy reference

def sigmoid(x):
    return 1 / (1 + np.exp(-x))


def ref_cell(kind, layer, sfx, x, h, c):
    p = {n: layer.params[n].value.astype(np.float64) for n in layer.params if n.endswith(sfx)}
    zero = np.zeros(layer.gates * layer.hidden_size)
    b_ih = p.get("bias_ih" + sfx, zero)
    b_hh = p.get("bias_hh" + sfx, zero)
    gi = x @ p["weight_ih" + sfx].T + b_ih
    gh = h @ p["weight_hh" + sfx].T + b_hh
    H = layer.hidden_size
    if kind.startswith("rnn"):
        z = gi + gh
        return (np.tanh(z) if layer.nonlinearity == "tanh" else np.maximum(z, 0)), None
    if kind == "lstm":
        z = gi + gh
        i, f, g, o = sigmoid(z[:H]), sigmoid(z[H:2 * H]), np.tanh(z[2 * H:3 * H]), sigmoid(z[3 * H:])
        c = f * c + i * g
        return o * np.tanh(c), c
    r = sigmoid(gi[:H] + gh[:H])
    u = sigmoid(gi[H:2 * H] + gh[H:2 * H])
    if kind == "gru_reset_first":  # (r h) W_hnᵀ + b_hn
        n = np.tanh(gi[2 * H:] + (r * h) @ p["weight_hh" + sfx][2 * H:].T + b_hh[2 * H:])
    else:
        n = np.tanh(gi[2 * H:] + r * gh[2 * H:])
    return (1 - u) * n + u * h, None


def reference(kind, layer, seqs, h0=None, c0=None):
    """Every sequence on its own, every layer and direction a loop over time."""
    L, D, H = layer.num_layers, layer.directions, layer.hidden_size
    outs, lasts, cells = [], [], []
    for s in range(seqs.num_sequences):
        inp = seqs[s].astype(np.float64)
        last = np.zeros((L * D, H))
        cell = np.zeros((L * D, H))
        for l in range(L):
            out = np.zeros((len(inp), D * H))
            for d in range(D):
                k = l * D + d
                h = h0[s, k].copy() if h0 is not None else np.zeros(H)
                c = c0[s, k].copy() if c0 is not None else np.zeros(H)
                steps = range(len(inp))
                if d == 1 or layer.reverse:
                    steps = reversed(steps)
                for t in steps:
                    h, c_new = ref_cell(kind, layer, layer._suffix(l, d), inp[t], h, c)
                    c = c_new if c_new is not None else c
                    out[t, d * H:(d + 1) * H] = h
                last[k], cell[k] = h, c
            inp = out
        outs.append(inp)
        lasts.append(last)
        cells.append(cell)
    return np.concatenate(outs), np.stack(lasts), np.stack(cells)


def batch(lengths, features, seed=0, dtype=np.float64):
    rng = np.random.default_rng(seed)
    return lm.Sequences.from_list([rng.standard_normal((n, features)).astype(dtype) for n in lengths])


OPTIONS = [
    dict(),
    dict(reverse=True),
    dict(bidirectional=True),
    dict(num_layers=2),
    dict(num_layers=2, bidirectional=True, bias=False),
]
LENGTHS = [3, 1, 3, 2]  # ties (3, 3), a length-1 sequence


def network(kind, options, initial=False, dtype="float32", packed=False, in_size=2, hidden=3):
    net = lm.Network(dtype=dtype)
    x = net.input("x", in_size, sequence=True)
    layer = make(kind, input_size=in_size, hidden_size=hidden, packed=packed, **options)
    ins = [x]
    states = layer.num_layers * layer.directions
    if initial:
        ins.append(net.input("h0", (states, hidden)))
        if kind == "lstm":
            ins.append(net.input("c0", (states, hidden)))
    outs = layer(*ins)
    return net, layer, outs


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("initial", [False, True])
def test_matches_the_per_sequence_reference(kind, options, initial):
    net, layer, outs = network(kind, options, initial, dtype="float64")
    net.outputs(*outs)
    net.astype("float64")
    seqs = batch(LENGTHS, 2, seed=1)
    rng = np.random.default_rng(2)
    states = layer.num_layers * layer.directions
    feeds = {"x": seqs}
    h0 = c0 = None
    if initial:
        feeds["h0"] = h0 = rng.standard_normal((len(LENGTHS), states, 3))
        if kind == "lstm":
            feeds["c0"] = c0 = rng.standard_normal((len(LENGTHS), states, 3))
    got = net.run(feeds)
    out, last, cell = reference(kind, layer, seqs, h0, c0)
    np.testing.assert_allclose(got[outs[0].name].values, out, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(got[outs[0].name].starts, seqs.starts)
    np.testing.assert_allclose(got[outs[1].name], last, rtol=1e-12, atol=1e-12)
    if kind == "lstm":
        np.testing.assert_allclose(got[outs[2].name], cell, rtol=1e-12, atol=1e-12)


def probed(kind, options, initial, lengths, packed=False, hidden=3):
    net, layer, outs = network(kind, options, initial, packed=packed, hidden=hidden)
    probes = [add_probe_cost(net, v) for v in outs]
    net.astype("float64")
    seqs = batch(lengths, 2, seed=3)
    rng = np.random.default_rng(4)
    states = layer.num_layers * layer.directions
    feeds = {"x": seqs}
    if initial:
        feeds["h0"] = rng.standard_normal((len(lengths), states, hidden))
        if kind == "lstm":
            feeds["c0"] = rng.standard_normal((len(lengths), states, hidden))
    for name, v in zip(probes, outs):
        feeds[name] = probe_feed(net, name, seqs if v.spec.sequence else len(lengths), seed=5)
    return net, feeds


@pytest.mark.parametrize("kind", sorted(LAYERS))
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "plain")
@pytest.mark.parametrize("initial", [False, True])
def test_gradients(kind, options, initial):
    net, feeds = probed(kind, options, initial, LENGTHS)
    check_gradients(net, feeds)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru", "gru_reset_first"])
@pytest.mark.parametrize("lengths", [[4], [1], [1, 1, 1]], ids=["one-sequence", "one-step", "all-length-1"])
def test_gradients_small_batches(kind, lengths):
    net, feeds = probed(kind, dict(bidirectional=True), True, lengths)
    check_gradients(net, feeds)


@pytest.mark.parametrize("blas", BLAS_PROVIDERS)
@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru", "gru_reset_first"])
def test_gradients_packed_path(kind, blas):
    """Both pack formats (MKL's packed GEMM in float64, lamina's panels), whatever this machine's
    default provider."""
    net, feeds = probed(kind, dict(bidirectional=True), True, LENGTHS, packed=True)
    net.to(CPUBackend(blas=blas))
    check_gradients(net, feeds)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("share,hidden", [("rows", 5), ("units", 16)])
def test_gradients_fused_recurrence(kind, share, hidden, monkeypatch):
    """The fused recurrence (pyx/recurrence.h) on two threads, sharing the batch by sequences
    (any hidden size) or by blocks of units (float64: 16 units are two panels, one per thread)."""
    calls = spy_fused(monkeypatch, by_rows=share == "rows")
    net, feeds = probed(kind, dict(bidirectional=True), True, LENGTHS, packed=True, hidden=hidden)
    net.to(CPUBackend(blas="openblas"))  # the fused path is for lamina's panels, not MKL's packs
    before = lm.get_num_threads()
    lm.set_num_threads(2)
    try:
        check_gradients(net, feeds, max_points=300)
    finally:
        lm.set_num_threads(before)
    assert set(calls) == {("forward", 2, share == "rows"), ("backward", 2, share == "rows")}


def spy_fused(monkeypatch, by_rows=None):
    """Force the fused recurrence onto every thread, sharing by rows or by units (by_rows None:
    as the backend decides); returns (forward|backward, threads, by_rows) per call (the kernels
    take threads, by_rows last)."""
    import lamina.backends.cpu.fused_recurrence as recurrence
    calls, kernels = [], recurrence._kernels

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

        @staticmethod
        def recurrence_forward(*args):
            calls.append(("forward", args[-2], args[-1]))
            return kernels.recurrence_forward(*args)

        @staticmethod
        def recurrence_backward(*args):
            calls.append(("backward", args[-2], args[-1]))
            return kernels.recurrence_backward(*args)
    if by_rows is not None:
        monkeypatch.setattr(recurrence, "FUSED_PARALLEL_MIN", 0)
        monkeypatch.setattr(recurrence, "ROWS_PER_THREAD", 1)
        monkeypatch.setattr(recurrence, "FUSED_SHARE", "rows" if by_rows else "units")
    monkeypatch.setattr(recurrence, "_kernels", Spy())
    return calls


@pytest.mark.parametrize("hidden, steps, threads", [(32, 20, 1), (256, 20, 2), (256, 3, 1)])
def test_a_lone_sequence_splits_a_large_recurrent_weight(hidden, steps, threads, monkeypatch):
    """One sequence is few multiply-adds, so one thread, unless W_hh is too large for one core's
    cache (hidden 256: 1 MB): then the threads share its units, given at least
    UNITS_MIN_STEPS steps (fewer do not repay waking the other thread)."""
    from lamina.backends.cpu.fused_recurrence import UNITS_MIN_STEPS
    assert 3 < UNITS_MIN_STEPS <= 20
    calls = spy_fused(monkeypatch)
    net = lm.Network()
    x = net.input("x", 8, sequence=True)
    net.outputs(y=LSTM(8, hidden)(x)[0])
    net.to(CPUBackend(blas="openblas"))
    before = lm.get_num_threads()
    lm.set_num_threads(2)
    try:
        net.run({"x": batch([steps], 8, dtype=np.float32)})
    finally:
        lm.set_num_threads(before)
    assert calls == [("forward", threads, False)]


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("share", ["rows", "units"])
def test_packed_and_plain_paths_agree(kind, threads, share, monkeypatch):
    """Step by step with plain GEMMs against the packed weight; with hidden size 32 on the
    OpenBLAS provider that is the fused recurrence, here on up to 3 threads sharing 5 sequences
    or 2 panels of units."""
    calls = spy_fused(monkeypatch, by_rows=share == "rows")
    before = lm.get_num_threads()
    lm.set_num_threads(threads)
    try:
        results = packed_and_plain_results(kind)
    finally:
        lm.set_num_threads(before)
    team = threads if share == "rows" else min(threads, 2)  # (a thread per panel at most)
    assert set(calls) == {("forward", team, share == "rows"), ("backward", team, share == "rows")}
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def packed_and_plain_results(kind):
    results = []
    for packed in (False, True):
        lm.manual_seed(7)
        net, layer, outs = network(kind, dict(num_layers=2, bidirectional=True), packed=packed, in_size=16, hidden=32)
        net.outputs(*outs)
        net.to(CPUBackend(blas="openblas"))
        seqs = batch([7, 3, 7, 1, 5], 16, seed=8, dtype=np.float32)
        net.forward({"x": seqs}, grad_outputs=[outs[0].name])
        g = np.random.default_rng(9).standard_normal(seqs.values.shape[:1] + (64,)).astype(np.float32)
        net.backward(grad_outputs={outs[0].name: g})
        results.append((net.scheduler.current.values[outs[0].name].copy(),
                        [p.grad.copy() for p in net.parameters()]))
    return results


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("blas", BLAS_PROVIDERS)
def test_input_projection_packed_or_not(kind, blas, monkeypatch):
    """The input projection runs on the packed W_ih up to PACKED_INPUT_ROWS rows and as a general
    GEMM above: a 2-layer bidirectional layer over 40 rows gives the same states and gradients
    either way, and a batch across the threshold the states of its sequences run alone."""
    from lamina.layers import recurrent
    lm.manual_seed(3)
    net, layer, outs = network(kind, dict(num_layers=2, bidirectional=True), packed=True, in_size=16, hidden=32)
    net.outputs(*outs)
    net.to(CPUBackend(blas=blas))
    seqs = batch([9, 30, 1], 16, seed=4, dtype=np.float32)
    g = np.random.default_rng(5).standard_normal((40, 64)).astype(np.float32)
    results = []
    for limit in (0, 10 ** 9):
        monkeypatch.setattr(recurrent, "PACKED_INPUT_ROWS", limit)
        net.forward({"x": seqs}, grad_outputs=[outs[0].name])
        net.backward(grad_outputs={outs[0].name: g})
        results.append((net.scheduler.current.values[outs[0].name].copy(), [p.grad.copy() for p in net.parameters()]))
        net.zero_grad()
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5, atol=1e-6)
    for a, b in zip(results[0][1], results[1][1]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
    monkeypatch.setattr(recurrent, "PACKED_INPUT_ROWS", 256)
    many = batch([50] * 4 + [37, 80], 16, seed=6, dtype=np.float32)  # 317 rows: a general GEMM
    together = net.run({"x": many})[outs[0].name]
    for i in range(len(many)):
        alone = net.run({"x": lm.Sequences.from_list([many[i]])})[outs[0].name].values
        np.testing.assert_allclose(alone, together[i], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
def test_pack_follows_the_weights(kind, tmp_path):
    """Run, update, run: the packed path sees the new weights; so does a freshly loaded model."""
    net, layer, outs = network(kind, {}, packed=True, in_size=4, hidden=5)
    cost = lm.layers.SquareError()(outs[1], net.input("t", (1, 5)))
    net.outputs(out=outs[0], cost=cost)
    seqs = batch([3, 2], 4, seed=10, dtype=np.float32)
    before = net.run({"x": seqs})["out"].values
    net.train_step({"x": seqs, "t": np.ones((2, 1, 5), np.float32)}, lm.optim.SGD(net, lr=0.5))
    after = net.run({"x": seqs})["out"].values
    assert not np.allclose(before, after, atol=1e-3)
    np.testing.assert_allclose(after, reference(kind, layer, seqs)[0], rtol=1e-5, atol=1e-6)
    lm.save(net, tmp_path / "m.lamina")
    loaded = lm.load(tmp_path / "m.lamina")
    np.testing.assert_allclose(loaded.run({"x": seqs})["out"].values, after, rtol=1e-6)


# ---------------------------------------------------------------- PyTorch parity

@pytest.mark.parametrize("kind", ["rnn", "lstm", "gru"])
@pytest.mark.parametrize("options", [dict(), dict(num_layers=2, bidirectional=True)], ids=["plain", "2-layer-bidir"])
def test_matches_pytorch(kind, options):
    import torch  # a test extra: installed by make test, never skipped
    lm.manual_seed(11)
    net, layer, outs = network(kind, options, initial=True, in_size=5, hidden=6)
    net.outputs(*outs)
    module = {"rnn": torch.nn.RNN, "lstm": torch.nn.LSTM, "gru": torch.nn.GRU}[kind](
        5, 6, num_layers=layer.num_layers, bidirectional=layer.bidirectional)
    with torch.no_grad():
        for name, p in module.named_parameters():
            p.copy_(torch.from_numpy(layer.params[name].value.copy()))
    lengths = [6, 2, 6, 4]
    seqs = batch(lengths, 5, seed=12, dtype=np.float32)
    rng = np.random.default_rng(13)
    states = layer.num_layers * layer.directions
    h0 = rng.standard_normal((4, states, 6)).astype(np.float32)
    c0 = rng.standard_normal((4, states, 6)).astype(np.float32)
    feeds = {"x": seqs, "h0": h0}
    if kind == "lstm":
        feeds["c0"] = c0
    got = net.run(feeds)
    packed = torch.nn.utils.rnn.pack_sequence([torch.from_numpy(s) for s in seqs.to_list()], enforce_sorted=False)
    th0 = torch.from_numpy(h0.transpose(1, 0, 2).copy())
    with torch.no_grad():
        if kind == "lstm":
            out, (hn, cn) = module(packed, (th0, torch.from_numpy(c0.transpose(1, 0, 2).copy())))
        else:
            out, hn = module(packed, th0)
    padded, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
    expected = np.concatenate([padded[i, :n].numpy() for i, n in enumerate(lengths)])
    np.testing.assert_allclose(got[outs[0].name].values, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[outs[1].name], hn.numpy().transpose(1, 0, 2), rtol=1e-5, atol=1e-6)
    if kind == "lstm":
        np.testing.assert_allclose(got[outs[2].name], cn.numpy().transpose(1, 0, 2), rtol=1e-5, atol=1e-6)


EXTENDED = [dict(peepholes=True), dict(clip=0.5), dict(peepholes=True, clip=0.7)]
EXTENDED_IDS = ["peepholes", "clip", "peepholes-clip"]


@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
@pytest.mark.parametrize("options", EXTENDED, ids=EXTENDED_IDS)
def test_lstm_peepholes_and_clip_gradients(options, bidirectional):
    """float64 gradient check of every input, initial state and parameter (the peephole vectors
    included), over ragged sequences large enough that many gates clip."""
    D = 2 if bidirectional else 1
    net = lm.Network()
    x = net.input("x", 3, sequence=True)
    h0, c0 = net.input("h0", (D, 4)), net.input("c0", (D, 4))
    y, _, cell = LSTM(3, 4, bidirectional=bidirectional, **options)(x, h0, c0)
    probes = [add_probe_cost(net, y), add_probe_cost(net, cell)]
    net.astype("float64")
    rng = np.random.default_rng(0)
    seqs = lm.Sequences.from_list([rng.standard_normal((n, 3)) * 2 for n in (5, 3, 1)])
    feeds = {"x": seqs, "h0": rng.standard_normal((3, D, 4)), "c0": 2 * rng.standard_normal((3, D, 4)),
             probes[0]: probe_feed(net, probes[0], seqs), probes[1]: probe_feed(net, probes[1], 3)}
    check_gradients(net, feeds)


@pytest.mark.parametrize("options", EXTENDED, ids=EXTENDED_IDS)
def test_lstm_peepholes_and_clip_match_the_numpy_loop(options, tmp_path):
    """i, f read p ⊙ c_{t-1}, o reads p ⊙ c_t, every pre-activation clipped: a numpy loop, step by
    step, for each sequence of a ragged batch; the model file keeps both settings."""
    rng = np.random.default_rng(1)
    layer = LSTM(3, 5, name="lstm", **options)
    net = lm.Network()
    x, c0 = net.input("x", 3, sequence=True), net.input("c0", (1, 5))
    y, last, cell = layer(x, net.input("h0", (1, 5)), c0)
    net.outputs(y=y, cell=cell)
    seqs = [2 * rng.standard_normal((n, 3)).astype(np.float32) for n in (4, 6, 1)]
    h0, c0 = rng.standard_normal((3, 1, 5)).astype(np.float32), rng.standard_normal((3, 1, 5)).astype(np.float32)
    out = net.run({"x": lm.Sequences.from_list(seqs), "h0": h0, "c0": c0})
    P = {k: v.value.astype(np.float64) for k, v in layer.params.items()}
    peep = P.get("weight_peephole_l0", np.zeros((3, 5)))
    clip = (lambda v: np.clip(v, -options["clip"], options["clip"])) if "clip" in options else (lambda v: v)
    ys = []
    for n, seq in enumerate(seqs):
        h, c = h0[n, 0].astype(np.float64), c0[n, 0].astype(np.float64)
        for step in seq:
            z = P["weight_ih_l0"] @ step + P["weight_hh_l0"] @ h + P["bias_ih_l0"] + P["bias_hh_l0"]
            zi, zf, zg, zo = np.split(z, 4)
            i, f = sigmoid(clip(zi + peep[0] * c)), sigmoid(clip(zf + peep[1] * c))
            c = f * c + i * np.tanh(clip(zg))
            h = sigmoid(clip(zo + peep[2] * c)) * np.tanh(c)
            ys.append(h)
        np.testing.assert_allclose(out["cell"][n, 0], c, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["y"].values, np.array(ys), rtol=1e-5, atol=1e-6)
    lm.save(net, tmp_path / "m.lamina")
    loaded = lm.load(tmp_path / "m.lamina")
    assert (loaded.layer("lstm").peepholes, loaded.layer("lstm").clip) == (layer.peepholes, layer.clip)
    again = loaded.run({"x": lm.Sequences.from_list(seqs), "h0": h0, "c0": c0})
    np.testing.assert_array_equal(again["y"].values, out["y"].values)
    with pytest.raises(ValueError, match="clip must be a positive threshold, found 0"):
        LSTM(3, 5, clip=0)
