"""Embedding, sequence pooling and sequence softmax: numpy references, gradient checks, sparse
embedding gradients and updates, and sequence batches flowing through ordinary layers."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import LSTM, Embedding, Linear, SequencePool, SequenceSoftmax, SoftmaxCrossEntropy
from lamina.testing import add_probe_cost, check_gradients, probe_feed

LENGTHS = [3, 1, 4, 2]


def seq_batch(features=3, seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return lm.Sequences.from_list([rng.standard_normal((n, features)) for n in lengths])


def id_batch(vocab=7, seed=0, lengths=LENGTHS):
    rng = np.random.default_rng(seed)
    return lm.Sequences.from_list([rng.integers(0, vocab, n).astype(np.int32) for n in lengths])


@pytest.mark.parametrize("mode", ["last", "first", "average", "sum", "max"])
def test_sequence_pool(mode):
    net = lm.Network()
    x = net.input("x", 3, sequence=True)
    pooled = SequencePool(mode)(x)
    probe = add_probe_cost(net, pooled)
    net.astype("float64")
    seqs = seq_batch()
    feeds = {"x": seqs, probe: probe_feed(net, probe, len(LENGTHS))}
    check_gradients(net, feeds)
    want = {"last": lambda s: s[-1], "first": lambda s: s[0], "average": lambda s: s.mean(0),
            "sum": lambda s: s.sum(0), "max": lambda s: s.max(0)}[mode]
    net.outputs(pooled=pooled)
    got = net.run({"x": seqs}, outputs=["pooled"])["pooled"]
    np.testing.assert_allclose(got, np.stack([want(s) for s in seqs.to_list()]), rtol=1e-14)


def test_sequence_softmax():
    net = lm.Network()
    x = net.input("x", 1, sequence=True)
    y = SequenceSoftmax()(x)
    probe = add_probe_cost(net, y)
    net.astype("float64")
    seqs = seq_batch(features=1)
    feeds = {"x": seqs, probe: probe_feed(net, probe, seqs)}
    check_gradients(net, feeds)
    net.outputs(y=y)
    got = net.run({"x": seqs}, outputs=["y"])["y"]
    for s, g in zip(seqs.to_list(), got.to_list()):
        np.testing.assert_allclose(g, np.exp(s) / np.exp(s).sum(), rtol=1e-14)


def embedding_lm(vocab=7, tie=False):
    """ids -> Embedding -> LSTM -> Linear -> per-step softmax cross-entropy on next ids."""
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    nxt = net.input("next", dtype="int32", sequence=True)
    emb = Embedding(vocab, 4, name="emb")
    h = LSTM(4, 4)(emb(ids))[0]
    out = Linear(4, vocab, name="out")
    if tie:
        out.tie("weight", emb.weight)
    loss = SoftmaxCrossEntropy()(out(h), nxt)
    net.outputs(loss=loss)
    return net, emb


@pytest.mark.parametrize("tie", [False, True], ids=["separate", "tied-to-output-layer"])
def test_embedding_gradients(tie):
    net, emb = embedding_lm(tie=tie)
    net.astype("float64")
    feeds = {"ids": id_batch(seed=1), "next": id_batch(seed=2)}
    check_gradients(net, feeds)


def test_embedding_matches_numpy_and_checks_ids():
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    emb = Embedding(7, 4, name="emb")
    net.outputs(y=emb(ids))
    batch = id_batch()
    got = net.run({"ids": batch})["y"]
    np.testing.assert_array_equal(got.values, emb.weight.value[batch.values])
    bad = lm.Sequences(np.array([1, 9], np.int32), np.array([0, 2], np.int32))
    with pytest.raises(lm.InputError, match=r"layer 'emb' \(Embedding\): ids must lie in \[0, 7\), found 9"):
        net.run({"ids": bad})


def test_sparse_embedding_update_touches_only_used_rows():
    lm.manual_seed(3)
    net, emb = embedding_lm(vocab=50)
    feeds = {"ids": id_batch(vocab=10, seed=4), "next": id_batch(vocab=10, seed=5)}
    used = np.unique(feeds["ids"].values)
    before = emb.weight.value.copy()
    net.forward(feeds)
    net.backward()
    assert emb.weight.grad_rows.tolist() == used.tolist()
    dense = emb.weight.grad.copy()
    dense[np.setdiff1d(np.arange(50), used)] = 0
    opt = lm.optim.SGD(net, lr=0.1)
    opt.begin_step()
    for p in net.parameters():
        opt.update(p)
    opt.end_step()
    after = emb.weight.value
    unused = np.setdiff1d(np.arange(50), used)
    np.testing.assert_array_equal(after[unused], before[unused])  # bit for bit: never touched
    np.testing.assert_allclose(after, before - 0.1 * dense, rtol=1e-6)


@pytest.mark.parametrize("optimizer", ["SGD-momentum", "Adam", "AdaGrad"])
def test_sparse_and_dense_gradients_give_the_same_update(optimizer):
    """Where a sparse update would not be exact (momentum, Adam) the gradient is made dense; where
    it is (AdaGrad without decay) only the rows move. Either way the result equals training the
    same network with the embedding's gradient made dense by hand."""
    make = {"SGD-momentum": lambda n: lm.optim.SGD(n, lr=0.1, momentum=0.9),
            "Adam": lambda n: lm.optim.Adam(n, lr=0.01), "AdaGrad": lambda n: lm.optim.AdaGrad(n, lr=0.1)}[optimizer]
    results = []
    for densify in (False, True):
        lm.manual_seed(6)
        net, emb = embedding_lm(vocab=30)
        opt = make(net)
        for step in range(3):
            feeds = {"ids": id_batch(vocab=30, seed=10 + step), "next": id_batch(vocab=30, seed=20 + step)}
            net.forward(feeds)
            opt.begin_step()
            net.backward(on_ready=(lambda p: (p.dense_grad(net.backend), opt.update(p))) if densify else opt.update)
            opt.end_step()
        results.append(emb.weight.value.copy())
    np.testing.assert_allclose(results[0], results[1], rtol=1e-6, atol=1e-7)


def test_sequences_flow_through_ordinary_layers():
    """A Linear on a sequence batch works row by row; a per-step cost averages over all steps."""
    net = lm.Network(dtype="float64")
    x = net.input("x", 3, sequence=True)
    t = net.input("t", 2, sequence=True)
    fc = Linear(3, 2)
    y = fc(x)
    net.outputs(y=y, cost=lm.layers.SquareError()(y, t))
    net.astype("float64")
    seqs = seq_batch()
    targets = lm.Sequences(np.zeros((seqs.total_steps, 2)), seqs.starts)
    out = net.forward({"x": seqs, "t": targets})
    loss = net.backward()
    ref = seqs.values @ fc.weight.value.T + fc.bias.value
    np.testing.assert_allclose(out["y"], ref, rtol=1e-14)
    assert loss == pytest.approx((ref ** 2).sum() / seqs.total_steps, rel=1e-12)


def test_sequence_inputs_must_share_offsets():
    net = lm.Network()
    a, b = net.input("a", 2, sequence=True), net.input("b", 2, sequence=True)
    net.outputs(y=lm.layers.Add()(a, b))
    x = lm.Sequences(np.zeros((4, 2), np.float32), np.array([0, 1, 4], np.int32))
    y = lm.Sequences(np.zeros((4, 2), np.float32), np.array([0, 2, 4], np.int32))
    with pytest.raises(lm.InputError, match="input 'b': its sequence offsets differ"):
        net.run({"a": x, "b": y})
    with pytest.raises(lm.InputError, match="input 'a': expected a lamina.Sequences batch"):
        net.run({"a": np.zeros((4, 2), np.float32), "b": y})
    with pytest.raises(lm.GraphError, match="mix sequence batches and per-sample rows"):
        lm.layers.Linear([2, 2], 3)(a, net.input("c", 2))
