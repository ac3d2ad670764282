"""The encoders users bring as ONNX: `torch.nn.TransformerEncoder` classifiers and Hugging Face
BERT, DistilBERT and RoBERTa models built from small configs (random weights, nothing
downloaded), each exported by both of PyTorch's exporters with the example input's static shapes
(PyTorch's default). Each loads with its attention subgraphs as MultiheadAttention layers and its
attention mask as the batch's lengths, matches ONNX Runtime on the padded batch to 1e-4 of the
output's scale, runs ragged batches as each sequence alone, fine-tunes, and exports back."""
import io
import warnings

import numpy as np
import pytest

import lamina as lm

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
nn = torch.nn

VOCAB, WIDTH, HEADS, FEED_FORWARD, POSITIONS = 50, 32, 4, 64, 40
BATCH, STEPS = 3, 7  # the example input's static shape


class EncoderClassifier(nn.Module):
    """Token embeddings, a 2-layer nn.TransformerEncoder (batch first; a key padding mask from the
    ids or from a mask input), the mean, maximum or first step over time, a linear head: the
    classifier users write with torch.nn."""

    def __init__(self, norm_first=False, activation="relu", pool="mean", padding=None):
        super().__init__()
        self.pool, self.padding = pool, padding
        self.embed = nn.Embedding(VOCAB, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, HEADS, FEED_FORWARD, dropout=0.0, batch_first=True,
                                           norm_first=norm_first, activation=activation)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, ids, mask=None):
        # the key padding mask: none, where the ids are the padding id 1, or from a mask input
        pad = None if self.padding is None else (ids == 1) if self.padding == "ids" else (mask == 0)
        h = self.encoder(self.embed(ids), src_key_padding_mask=pad)
        return self.head(h.mean(1) if self.pool == "mean" else h.amax(1) if self.pool == "max" else h[:, 0])


class Wrapped(nn.Module):
    """A Hugging Face model's `field` (last_hidden_state, or a classifier's logits) from input_ids
    and attention_mask."""

    def __init__(self, model, field="last_hidden_state"):
        super().__init__()
        self.model, self.field = model, field

    def forward(self, ids, mask):
        return getattr(self.model(input_ids=ids, attention_mask=mask), self.field)


class MeanPooled(nn.Module):
    """A sentence embedding as sentence-transformers computes it: BERT's hidden states averaged
    over each sequence's real tokens (weighted by the mask, divided by its sum clamped at 1e-9)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids, mask):
        hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state
        weights = mask.unsqueeze(-1).to(hidden.dtype)
        return (hidden * weights).sum(1) / torch.clamp(weights.sum(1), min=1e-9)


def hugging_face(kind):
    t = transformers
    sizes = dict(vocab_size=VOCAB, max_position_embeddings=POSITIONS)
    if kind == "distilbert":
        config = t.DistilBertConfig(dim=WIDTH, n_layers=2, n_heads=HEADS, hidden_dim=FEED_FORWARD, dropout=0.0,
                                    attention_dropout=0.0, **sizes)
        return Wrapped(t.DistilBertModel(config))
    common = dict(hidden_size=WIDTH, num_hidden_layers=2, num_attention_heads=HEADS, intermediate_size=FEED_FORWARD,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **sizes)
    if kind == "bert":
        return Wrapped(t.BertModel(t.BertConfig(**common), add_pooling_layer=False))
    if kind == "bert-mean-pooled":
        return MeanPooled(t.BertModel(t.BertConfig(**common), add_pooling_layer=False))
    if kind == "bert-classifier":
        return Wrapped(t.BertForSequenceClassification(t.BertConfig(num_labels=3, **common)), "logits")
    return Wrapped(t.RobertaModel(t.RobertaConfig(**common), add_pooling_layer=False))


MODELS = {
    "torch-post-norm": lambda: EncoderClassifier(),
    "torch-pre-norm-gelu": lambda: EncoderClassifier(norm_first=True, activation="gelu"),
    "torch-max-pooled": lambda: EncoderClassifier(pool="max"),
    "torch-padding-from-ids": lambda: EncoderClassifier(pool="first", padding="ids"),
    "torch-padding-mask": lambda: EncoderClassifier(pool="first", padding="mask"),
    "bert": lambda: hugging_face("bert"),
    "distilbert": lambda: hugging_face("distilbert"),
    "roberta": lambda: hugging_face("roberta"),
    "bert-classifier": lambda: hugging_face("bert-classifier"),
    "bert-mean-pooled": lambda: hugging_face("bert-mean-pooled"),
}
MASKED = {"bert", "distilbert", "roberta", "bert-classifier", "bert-mean-pooled", "torch-padding-mask"}  # taking an attention mask beside the ids
CASES = [(name, dynamo) for name in MODELS for dynamo in (True, False)]
IDS = [f"{n}-{'dynamo' if d else 'torchscript'}" for n, d in CASES]


def build(name):
    torch.manual_seed(sum(map(ord, name)))
    model = MODELS[name]().eval()
    with torch.no_grad():  # LayerNorm weights and biases off their initial ones and zeros
        for module in model.modules():
            if isinstance(module, nn.LayerNorm):
                module.weight.uniform_(0.5, 1.5)
                module.bias.uniform_(-0.2, 0.2)
    return model


def padded(lengths, steps=STEPS, seed=0):
    """ids [N, steps] (no padding id 1 among the tokens) and the prefix attention mask."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, VOCAB, (len(lengths), steps)).astype(np.int64)
    mask = (np.arange(steps)[None, :] < np.asarray(lengths)[:, None]).astype(np.int64)
    return np.where(mask == 1, ids, 1), mask


_EXPORTS = {}


def export(name, dynamo, dynamic=False, opset=None):
    """The model's ONNX bytes, exported at the example input's static shapes, or with the batch
    and time axes dynamic (cached per run)."""
    if (name, dynamo, dynamic, opset) not in _EXPORTS:
        model = build(name)
        ids, mask = padded([STEPS, STEPS - 2, 4])
        args = (torch.from_numpy(ids), torch.from_numpy(mask)) if name in MASKED else (torch.from_numpy(ids),)
        names = ["ids", "mask"][:len(args)]
        kw = {}
        if dynamic and dynamo:
            n, t = torch.export.Dim("n", max=64), torch.export.Dim("t", max=POSITIONS - 2)
            kw = {"dynamic_shapes": tuple({0: n, 1: t} for _ in names)}
        elif dynamic:
            kw = {"dynamic_axes": {k: {0: "n", 1: "t"} for k in names}}
        f = io.BytesIO()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if opset is not None:
                kw["opset_version"] = opset
            torch.onnx.export(model, args, f, dynamo=dynamo, input_names=names, verbose=False, **kw)
        _EXPORTS[name, dynamo, dynamic, opset] = model, f.getvalue()
    return _EXPORTS[name, dynamo, dynamic, opset]


def run_padded(net, ids, mask=None):
    feeds = {net.input_names[0]: ids} if mask is None else {net.input_names[0]: ids, net.onnx_masks[0]: mask}
    (key, out), = net.run(lm.onnx.feeds(net, feeds)).items()
    return lm.onnx.to_onnx_layout(out, net.onnx_axes[key])


def assert_close(ours, theirs, where=None):
    """Equal to 1e-4 of the output's scale; `where` the tokens inside the sequences (an output of
    hidden states)."""
    if where is not None and theirs.ndim == 3:
        ours, theirs = ours[where], theirs[where]
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * max(float(np.abs(theirs).max()), 1e-3))


@pytest.mark.parametrize("name,dynamo", CASES, ids=IDS)
def test_encoder_imports_and_matches_onnx_runtime(name, dynamo):
    """Every attention becomes one MultiheadAttention layer (no Softmax left); on the padded batch
    the rows inside each sequence equal ONNX Runtime's and PyTorch's."""
    model, blob = export(name, dynamo)
    net = lm.onnx.load(blob)
    kinds = [node.layer.kind for node in net.nodes]
    assert kinds.count("multihead_attention") == 2 and "softmax" not in kinds
    ids, mask = padded([STEPS, STEPS - 2, 4], seed=1)
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    if name in MASKED:
        assert net.input_names == ["ids"] and net.onnx_masks == ["mask"]
        theirs = session.run(None, {"ids": ids, "mask": mask})[0]
        ours = run_padded(net, ids, mask)
        assert_close(ours, theirs, mask.astype(bool))
        with torch.no_grad():
            assert_close(ours, model(torch.from_numpy(ids), torch.from_numpy(mask)).numpy(), mask.astype(bool))
    else:
        theirs = session.run(None, {"ids": ids})[0]
        ours = run_padded(net, ids)
        assert_close(ours, theirs)
        with torch.no_grad():
            assert_close(ours, model(torch.from_numpy(ids)).numpy())


@pytest.mark.parametrize("name,dynamo", [c for c in CASES if c[1]], ids=[i for i, c in zip(IDS, CASES) if c[1]])
def test_ragged_batch_equals_each_sequence_alone(name, dynamo):
    """A batch of sequences of 1 to 7 tokens packed without padding: each sequence's output equals
    that sequence run alone, and (the models taking a mask) ONNX Runtime's on the padded batch."""
    _, blob = export(name, dynamo)
    net = lm.onnx.load(blob)
    lengths = [5, 1, 7, 3, 6]
    ids, mask = padded(lengths, seed=2)
    batch = lm.Sequences.from_list([ids[i, :n].astype(np.int32) for i, n in enumerate(lengths)])
    (key, out), = net.run({"ids": batch}).items()
    rows = out.to_list() if isinstance(out, lm.Sequences) else list(out)
    for i, n in enumerate(lengths):
        (_, alone), = net.run({"ids": lm.Sequences.from_list([ids[i, :n].astype(np.int32)])}).items()
        alone = alone.to_list()[0] if isinstance(alone, lm.Sequences) else alone[0]
        np.testing.assert_allclose(rows[i], alone, rtol=0, atol=1e-5 * max(float(np.abs(alone).max()), 1e-3))
    if name in MASKED:
        theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(
            None, {"ids": ids[:BATCH], "mask": mask[:BATCH]})[0]
        if isinstance(out, lm.Sequences):  # hidden states, padded to the longest of the three
            ours = lm.onnx.to_onnx_layout(lm.Sequences.from_list(rows[:BATCH]), net.onnx_axes[key])
            theirs = theirs[:, :ours.shape[1]]
        else:
            ours = np.stack(rows[:BATCH])
        assert_close(ours, theirs, mask[:BATCH, :STEPS].astype(bool))


# the dynamo exports with dynamic shapes are the slowest cases of make test: two of them there (a
# PyTorch encoder and BERT), every one in the slow run
DYNAMIC = [pytest.param(name, dynamo, marks=() if not dynamo or name in ("torch-pre-norm-gelu", "bert")
                        else pytest.mark.slow, id=f"{name}-{'dynamo' if dynamo else 'torchscript'}")
           for name in MODELS for dynamo in (True, False) if not (name.startswith("torch") and not dynamo)]


@pytest.mark.parametrize("name,dynamo", DYNAMIC)
def test_dynamic_export_runs_at_other_sizes(name, dynamo):
    """Exported with dynamic batch and time axes (shape arithmetic on them, position ids sliced
    to the length, masks built from ranges), the model runs at other sizes as ONNX Runtime does."""
    model, blob = export(name, dynamo, dynamic=True)
    net = lm.onnx.load(blob)
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    for lengths in ([4], [11, 6, 9, 2]):
        ids, mask = padded(lengths, steps=max(lengths), seed=len(lengths))
        feeds = {"ids": ids, "mask": mask} if name in MASKED else {"ids": ids}
        theirs = session.run(None, feeds)[0]
        ours = run_padded(net, ids, mask if name in MASKED else None)
        assert_close(ours, theirs, mask.astype(bool))


def test_torchscript_fixes_the_time_size_of_multihead_attention():
    """PyTorch's TorchScript exporter writes nn.MultiheadAttention's time size into a Reshape even
    where the input declares it dynamic (ONNX Runtime fails at any other length too): the
    importer says so by the Softmax's name rather than running it at one length only."""
    _, blob = export("torch-post-norm", False, dynamic=True)
    with pytest.raises(lm.UnsupportedModelError, match=r"\(Softmax\): attention: could not evaluate the subgraph at "
                                                        r"N=2, T=5 .*the export may have fixed them"):
        lm.onnx.load(blob)


def test_a_mask_with_padding_inside_a_sequence_is_refused():
    _, blob = export("bert", True)
    net = lm.onnx.load(blob)
    ids, mask = padded([STEPS, STEPS, STEPS])
    mask[1, 2] = 0
    with pytest.raises(lm.InputError, match=r"input 'mask': row 1 of the attention mask is not ones followed by zeros"):
        lm.onnx.feeds(net, {"ids": ids, "mask": mask})


def test_the_padding_id_inside_a_sequence_is_refused():
    """RoBERTa numbers positions by skipping its padding id: lamina's sequences hold no padding, so
    that id inside a sequence is an InputError rather than other positions than the model's."""
    _, blob = export("roberta", True)
    net = lm.onnx.load(blob)
    assert net.onnx_reserved_ids == {"ids": [1]}
    ids, mask = padded([STEPS, 4, 2])
    ids[0, 3] = 1
    with pytest.raises(lm.InputError, match=r"input 'ids': id 1 appears inside a sequence"):
        lm.onnx.feeds(net, {"ids": ids, "mask": mask})


def test_a_padding_mask_computed_from_the_ids():
    """`src_key_padding_mask=(ids == pad)`: the padding id leaves each padded row's end (the
    lengths, by lm.onnx.feeds) and is refused inside a sequence, as RoBERTa's."""
    _, blob = export("torch-padding-from-ids", True)
    net = lm.onnx.load(blob)
    assert net.input_names == ["ids"] and net.onnx_reserved_ids == {"ids": [1]}
    ids, _ = padded([STEPS, 3, 5])
    assert lm.onnx.feeds(net, {"ids": ids})["ids"].lengths.tolist() == [STEPS, 3, 5]
    ids[0, 2] = 1
    with pytest.raises(lm.InputError, match=r"input 'ids': id 1 appears inside a sequence"):
        lm.onnx.feeds(net, {"ids": ids})


def test_a_sequence_longer_than_the_exported_positions_is_refused():
    """BERT's position embeddings were folded at the export's length: a longer sequence is an
    InputError naming the layer, not a silent wrong answer."""
    _, blob = export("bert", True)
    net = lm.onnx.load(blob)
    ids = lm.Sequences.from_list([np.arange(3, 3 + STEPS + 1, dtype=np.int32)])
    with pytest.raises(lm.InputError, match="longer than num_positions=7"):
        net.run({"ids": ids})


@pytest.mark.parametrize("name", ["torch-post-norm", "bert"])
def test_imported_encoder_fine_tunes(name):
    """The imported encoder with a loss attached trains: Adam steps on one ragged batch lower the
    loss, and every attention parameter receives a gradient."""
    _, blob = export(name, True)
    net = lm.onnx.load(blob)
    (out_name,), = [tuple(net.output_values)]
    out = net.values[net.output_values[out_name]]
    rng = np.random.default_rng(3)
    lengths = [7, 4, 2, 6]
    ids = lm.Sequences.from_list([rng.integers(3, VOCAB, n).astype(np.int32) for n in lengths])
    if out.spec.sequence:  # hidden states: a per-token regression target
        target = net.input("target", out.spec.shape, sequence=True)
        net.outputs(loss=lm.layers.SquareError()(out, target))
        feeds = {"ids": ids, "target": lm.Sequences.from_list(
            [rng.standard_normal((n, WIDTH)).astype(np.float32) for n in lengths])}
    else:
        labels = net.input("labels", dtype="int32")
        net.outputs(loss=lm.layers.SoftmaxCrossEntropy()(out, labels))
        feeds = {"ids": ids, "labels": np.array([0, 1, 2, 1], np.int32)}
    opt = lm.optim.Adam(net, lr=0.01)
    losses = [net.train_step(feeds, opt) for _ in range(6)]
    assert losses[-1] < losses[0], losses


@pytest.mark.parametrize("name", ["torch-pre-norm-gelu", "distilbert"])
def test_imported_encoder_exports_back(name):
    """lamina's export of the imported encoder runs in ONNX Runtime as lamina runs it."""
    _, blob = export(name, True)
    net = lm.onnx.load(blob)
    ids, mask = padded([STEPS, 3, 5], seed=4)
    ours = run_padded(net, ids, mask if name in MASKED else None)
    again = lm.onnx.save(net).SerializeToString()
    session = ort.InferenceSession(again, providers=["CPUExecutionProvider"])
    lengths = mask.sum(1).astype(np.int64) if name in MASKED else np.full(len(ids), STEPS, np.int64)
    feeds = {i.name: ids if i.name == "ids" else lengths for i in session.get_inputs()}
    theirs = session.run(None, feeds)[0]
    if name in MASKED:
        assert_close(ours, theirs[:, :STEPS] if theirs.ndim == 3 else theirs, mask.astype(bool))
    else:
        assert_close(ours, theirs)


class BiasedAttention(nn.Module):
    """Attention with a learned bias added to the scores (as T5's relative positions): not what
    lamina's layer computes, so the importer refuses it by the Softmax's name."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.qkv, self.out = nn.Linear(WIDTH, 3 * WIDTH), nn.Linear(WIDTH, WIDTH)
        self.bias = nn.Parameter(torch.randn(STEPS, STEPS))

    def forward(self, ids):
        q, k, v = self.qkv(self.embed(ids)).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / WIDTH ** 0.5 + self.bias
        return self.out(scores.softmax(-1) @ v)


def test_attention_that_lamina_does_not_compute_is_refused_by_name():
    torch.manual_seed(0)
    ids = torch.from_numpy(padded([STEPS] * 2)[0])
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(BiasedAttention().eval(), (ids,), f, dynamo=False)
    with pytest.raises(lm.UnsupportedModelError, match=r"\(Softmax\): attention: the subgraph around this Softmax is "
                                                        r"not multi-head self-attention"):
        lm.onnx.load(f.getvalue())


def test_gather_elements_of_more_than_64_entries_folds():
    """onnx's reference GatherElements (np.choose) takes at most 64 entries along the axis and
    returns a wrong shape past them; BERT's token types gather from a buffer of 512: the
    importer folds it right."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    data = np.arange(300, dtype=np.float32)[None] * 0.5
    picks = np.array([[3, 70, 299, -1]], np.int64)
    graph = helper.make_graph(
        [helper.make_node("GatherElements", ["data", "picks"], ["row"], axis=1),
         helper.make_node("Add", ["x", "row"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])],
        [numpy_helper.from_array(data, "data"), numpy_helper.from_array(picks, "picks")])
    net = lm.onnx.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    x = np.zeros((2, 4), np.float32)
    np.testing.assert_array_equal(net.run({"x": x})["y"], np.tile([[1.5, 35.0, 149.5, 149.5]], (2, 1)))


def test_decomposed_gelu_is_one_activation():
    """PyTorch's TorchScript exporter at opset 17 writes GELU as Div, Erf, Add, Mul, Mul: it loads
    as one GELU activation (which the product before it fuses), and the model still matches."""
    model, blob = export("bert-mean-pooled", False, opset=17)
    ops = {n.op_type for n in __import__("onnx").load_from_string(blob).graph.node}
    assert "Erf" in ops and "Gelu" not in ops
    net = lm.onnx.load(blob)
    kinds = [(node.layer.kind, node.layer.config().get("activation")) for node in net.nodes]
    assert kinds.count(("activation", "gelu")) == 2 and ("activation", "erf") not in kinds
    ids, mask = padded([STEPS, 2, 5], seed=6)
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"ids": ids, "mask": mask})[0]
    assert_close(run_padded(net, ids, mask), theirs)


class AlmostGelu(nn.Module):
    """0.5 x (1 + erf(x / 2)): the shape of GELU's decomposition, not GELU."""

    def forward(self, x):
        return 0.5 * x * (1 + torch.erf(x / 2))


def test_an_element_wise_subgraph_that_is_not_gelu_stays_as_it_is():
    x = torch.linspace(-3, 3, 12).reshape(2, 6)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(AlmostGelu(), (x,), f, dynamo=False, opset_version=17)
    net = lm.onnx.load(f.getvalue())
    assert ("activation", "erf") in [(n.layer.kind, n.layer.config().get("activation")) for n in net.nodes]
    (_, ours), = net.run({net.input_names[0]: x.numpy()}).items()
    np.testing.assert_allclose(ours, AlmostGelu()(x).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["torch-post-norm", "bert", pytest.param("roberta", marks=pytest.mark.slow)])
def test_damaged_encoder_exports_are_refused_by_node(name):
    """Encoder exports with a node dropped, an attribute changed or an input rewired either load or
    are refused with the importer's errors (every problem naming its node), never another
    exception: the attention, position and activation subgraphs the importer evaluates included."""
    import onnx
    from test_onnx_models import loads_or_is_refused_by_node
    rng = np.random.default_rng(sum(map(ord, name)))
    for dynamo, dynamic in ((True, False), (False, False), (True, True)):
        loads_or_is_refused_by_node(onnx.load_model_from_string(export(name, dynamo, dynamic)[1]), rng, 6)


def test_checking_an_attention_is_bounded_in_memory(monkeypatch):
    """The importer checks each attention by evaluating it at the export's sizes; where that would
    hold a tensor over the folding limit (an export at a huge example batch, or a damaged file
    claiming one), the attention is refused by name before anything is allocated."""
    from lamina.io.onnx import registry
    _, blob = export("bert", True)
    largest = 4 * 3 * BATCH * STEPS * WIDTH  # the queries, keys and values of x (above the scores here)
    monkeypatch.setattr(registry, "FOLD_LIMIT", largest)
    lm.onnx.load(blob)
    monkeypatch.setattr(registry, "FOLD_LIMIT", largest - 1)
    with pytest.raises(lm.UnsupportedModelError, match=r"\(Softmax\): attention: checking this attention at the "
                                                        r"export's sizes \(N=3, T=7\) would hold 8,064 bytes"):
        lm.onnx.load(blob)
