"""Suite `transformer`: a MiniLM-L6-shaped BERT encoder (vocabulary 8192, 6 layers, width 384,
12 heads, feed-forward 1536, GELU, post-norm, mean pooling over each sequence) on a batch of 32
requests, inference and a fine-tuning step, three ways:

- lamina: the encoder built from lamina's layers, the batch packed (each sequence at its own
  length, attention within it, no padding, no mask);
- pytorch-sdpa: Hugging Face `transformers`' BertModel (built from a config, random weights) in
  eager mode with `attn_implementation="sdpa"`, the batch padded to its longest sequence with an
  attention mask, as a user runs it;
- onnxruntime: that BertModel (the same weights, its eager attention: the form ONNX Runtime's
  optimizer recognises) exported by PyTorch's TorchScript exporter (padded input, mask input)
  and optimised by ONNX Runtime's transformer optimizer (`model_type="bert"`: fused Attention,
  SkipLayerNormalization, BiasGelu where it finds them), same padded feeds.

lamina-onnx is lamina running that same export (before ONNX Runtime's optimizer), imported: each
attention one layer, the mask the batch's lengths, the decomposed GELU one activation.

Cases: lengths uniform in 8..128 ("ragged"), and every length 128 ("uniform"); "bf16" runs the
products in bfloat16 (lamina's network precision; PyTorch's CPU autocast), where the CPU has
AVX512-BF16 or AMX; "train" is one step of a two-class classifier on the mean-pooled output
(cross-entropy, SGD) on the ragged batch.
Requires transformers, torch and onnxruntime (the bench extra); the ONNX file is written once into
build/bench/transformer/.
"""
import os

import numpy as np

from .harness import ROOT

FOLDER = os.path.join(ROOT, "build", "bench", "transformer")
VOCAB, WIDTH, LAYERS, HEADS, FEED_FORWARD, POSITIONS, BATCH = 8192, 384, 6, 12, 1536, 512, 32
LENGTHS = {"ragged": np.random.default_rng(7).integers(8, 129, BATCH), "uniform": np.full(BATCH, 128)}


def flops(lengths):
    """The useful multiply-adds x 2 of one forward over these lengths: the projections and the
    feed-forward per token, and the attention's scores and weighted sums per pair of tokens."""
    tokens, pairs = int(np.sum(lengths)), int(np.sum(np.square(lengths)))
    per_layer = tokens * (4 * WIDTH * WIDTH + 2 * WIDTH * FEED_FORWARD) + 2 * pairs * WIDTH
    return 2.0 * LAYERS * per_layer


def _ids(lengths):
    rng = np.random.default_rng(int(np.sum(lengths)))
    return [rng.integers(0, VOCAB, n).astype(np.int32) for n in lengths]


def _padded(lengths):
    """ids [N, T] padded with 0 to the longest, and the attention mask (1 on real tokens)."""
    seqs, longest = _ids(lengths), int(max(lengths))
    ids = np.zeros((len(seqs), longest), np.int64)
    mask = np.zeros((len(seqs), longest), np.int64)
    for i, s in enumerate(seqs):
        ids[i, :len(s)], mask[i, :len(s)] = s, 1
    return ids, mask


# ---------------------------------------------------------------- lamina

def lamina_encoder(train=False):
    import lamina as lm
    L = lm.layers
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    h = L.LayerNorm(WIDTH, eps=1e-12)(L.PositionalEmbedding(POSITIONS, WIDTH)(L.Embedding(VOCAB, WIDTH)(ids)))
    layer = L.TransformerEncoderLayer(WIDTH, HEADS, FEED_FORWARD, dropout=0.0, activation="gelu",
                                      layer_norm_eps=1e-12)
    pooled = L.SequencePool("average")(L.TransformerEncoder(layer, LAYERS, name="encoder")(h))
    if train:
        net.outputs(loss=L.SoftmaxCrossEntropy()(L.Linear(WIDTH, 2)(pooled), net.input("label", dtype="int32")))
    else:
        net.outputs(pooled=pooled)
    return net


def lamina_infer(kind, precision="float32"):
    import lamina as lm
    net = lamina_encoder().set_precision(precision)
    feeds = {"ids": lm.Sequences.from_list(_ids(LENGTHS[kind]))}
    return lambda: net.run(feeds)


def lamina_train(kind):
    import lamina as lm
    net = lamina_encoder(train=True)
    feeds = {"ids": lm.Sequences.from_list(_ids(LENGTHS[kind])), "label": np.arange(BATCH, dtype=np.int32) % 2}
    opt = lm.optim.SGD(net.parameters(), lr=1e-4)
    return lambda: net.train_step(feeds, opt)


# ---------------------------------------------------------------- PyTorch and ONNX Runtime

def _bert(attention="sdpa"):
    import torch
    from transformers import BertConfig, BertModel

    class MeanPooled(torch.nn.Module):
        """BertModel's last hidden states averaged over each sequence's real tokens."""

        def __init__(self):
            super().__init__()
            config = BertConfig(vocab_size=VOCAB, hidden_size=WIDTH, num_hidden_layers=LAYERS,
                                num_attention_heads=HEADS, intermediate_size=FEED_FORWARD,
                                max_position_embeddings=POSITIONS, hidden_dropout_prob=0.0,
                                attention_probs_dropout_prob=0.0, attn_implementation=attention)
            self.bert = BertModel(config, add_pooling_layer=False)

        def forward(self, ids, mask):
            hidden = self.bert(input_ids=ids, attention_mask=mask).last_hidden_state
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            return (hidden * weights).sum(1) / weights.sum(1)

    torch.manual_seed(0)
    return MeanPooled()


def torch_infer(kind, precision="float32"):
    import torch
    model = _bert().eval()
    ids, mask = (torch.from_numpy(a) for a in _padded(LENGTHS[kind]))
    reduced = precision == "bfloat16"

    def step():
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=reduced):
            model(ids, mask)
    return step


def torch_train(kind):
    import torch
    model = _bert().train()
    head = torch.nn.Linear(WIDTH, 2)
    ids, mask = (torch.from_numpy(a) for a in _padded(LENGTHS[kind]))
    labels = torch.arange(BATCH) % 2
    opt = torch.optim.SGD(list(model.parameters()) + list(head.parameters()), lr=1e-4)

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(head(model(ids, mask)), labels)
        loss.backward()
        opt.step()
    return step


def export_model():
    """build/bench/transformer/bert.onnx and its ONNX Runtime-optimised form bert_opt.onnx (once)."""
    import warnings
    import torch
    os.makedirs(FOLDER, exist_ok=True)
    path, optimised = os.path.join(FOLDER, "bert.onnx"), os.path.join(FOLDER, "bert_opt.onnx")
    if not os.path.exists(path):
        ids, mask = (torch.from_numpy(a) for a in _padded([5, 3]))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(_bert("eager").eval(), (ids, mask), path, dynamo=False, opset_version=17,
                              input_names=["ids", "mask"], output_names=["pooled"],
                              dynamic_axes={"ids": {0: "n", 1: "t"}, "mask": {0: "n", 1: "t"}, "pooled": {0: "n"}})
    if not os.path.exists(optimised):
        from onnxruntime.transformers import optimizer
        model = optimizer.optimize_model(path, model_type="bert", num_heads=HEADS, hidden_size=WIDTH)
        model.save_model_to_file(optimised)
    return optimised


def fused_operators():
    """How many of each fused operator ONNX Runtime's optimizer put into the file."""
    import onnx
    graph = onnx.load(export_model()).graph
    fused = ("Attention", "MultiHeadAttention", "SkipLayerNormalization", "EmbedLayerNormalization", "BiasGelu",
             "FastGelu", "Gelu")
    return {op: n for op in fused if (n := sum(node.op_type == op for node in graph.node))}


def lamina_onnx_infer(kind):
    """lamina running the ONNX export of the Hugging Face model (as onnxruntime's unoptimised
    input): each attention imported as one layer, the mask as the batch's lengths."""
    import lamina as lm
    net = lm.onnx.load(os.path.join(FOLDER, "bert.onnx"))
    ids, mask = _padded(LENGTHS[kind])
    feeds = lm.onnx.feeds(net, {"ids": ids, "mask": mask})
    return lambda: net.run(feeds)


def ort_infer(kind, threads, spin=True):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spin:  # (its workers sleep between calls instead of watching for work)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(export_model(), options, providers=["CPUExecutionProvider"])
    ids, mask = _padded(LENGTHS[kind])
    feeds = {"ids": ids, "mask": mask}
    return lambda: session.run(["pooled"], feeds)


def run(bench, threads, rounds, have_torch, have_ort=False):
    import importlib.util
    if not (have_torch and have_ort and importlib.util.find_spec("transformers")):
        return []
    export_model()
    rows = []
    for kind in LENGTHS:
        impls = {"lamina": ("bench.transformer:lamina_infer", [kind]),
                 "lamina-onnx": ("bench.transformer:lamina_onnx_infer", [kind]),
                 "pytorch-sdpa": ("bench.transformer:torch_infer", [kind]),
                 "onnxruntime": ("bench.transformer:ort_infer", [kind, threads])}
        rows += bench.time_case("transformer", f"minilm infer b{BATCH} {kind}", threads, impls,
                                flops(LENGTHS[kind]), rounds)
    for kind in LENGTHS:
        impls = {"lamina": ("bench.transformer:lamina_infer", [kind, "bfloat16"]),
                 "lamina-float32": ("bench.transformer:lamina_infer", [kind]),
                 "pytorch-sdpa": ("bench.transformer:torch_infer", [kind, "bfloat16"])}
        rows += bench.time_case("transformer", f"minilm infer b{BATCH} {kind} bf16", threads, impls,
                                flops(LENGTHS[kind]), rounds)
    impls = {"lamina": ("bench.transformer:lamina_train", ["ragged"]),
             "pytorch-sdpa": ("bench.transformer:torch_train", ["ragged"])}
    rows += bench.time_case("transformer", f"minilm train b{BATCH} ragged", threads, impls,
                            3 * flops(LENGTHS["ragged"]), rounds)
    return rows
