"""The networks and data the data-parallel tests train, shared by the MPI worker
(distributed_worker.py) and the single-process reference in test_distributed.py.

A case builds its network, the global batch of each step (sample indices) and the feeds of a
list of samples; `feeds(net, index, step, part)` draws its randomness (sampled negatives) from
(step, part), so the reference can rebuild each rank's shard and join them."""
from pathlib import Path

import numpy as np

import lamina as lm
from lamina.layers import Embedding, Linear, SelectedCrossEntropy, SelectiveLinear, SoftmaxCrossEntropy
from lamina.zoo import denoise, language

MODELS = Path(__file__).resolve().parent.parent / "models"


def optimizer(kind, net):
    if kind == "sgd":
        return lm.optim.SGD(net, lr=0.05, momentum=0.9)
    if kind == "sgd-rows":  # plain SGD: sparse gradients update only their rows
        return lm.optim.SGD(net, lr=0.5)
    if kind == "adam":
        return lm.optim.Adam(net, lr=1e-2)
    if kind == "adam-fine":
        # Adam moves every weight by about lr whatever its gradient's size, so weights whose
        # gradient is rounding noise move at random: in one process, only reordering the
        # samples of the language model's batches changes its weights after 10 steps by 1.8e-4
        # (relative) with lr 1e-2 and eps 1e-8, by 4.6e-7 with these fine-tuning settings
        return lm.optim.Adam(net, lr=1e-3, eps=1e-5)
    if kind == "adam-lazy":  # sparse gradients update only their rows' moments
        return lm.optim.Adam(net, lr=1e-2, lazy=True)
    if kind == "adam-clip":  # global-norm clipping sees the summed gradients
        return lm.optim.Adam(net, lr=1e-2, clip_norm=0.5)
    raise ValueError(kind)


class Classifier:
    """A small MLP on Gaussian data; 12 samples per global batch."""

    bucket_mb = 0.0005  # a few hundred bytes: several buckets per step

    def __init__(self):
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((240, 6)).astype(np.float32)
        self.y = (self.x[:, 0] > 0).astype(np.int32) + (self.x[:, 1] > 0.5).astype(np.int32)

    def network(self):
        net = lm.Network()
        x, y = net.input("x", 6), net.input("y", dtype="int32")
        h = Linear(6, 16, activation="tanh", name="hidden")(x)
        logits = Linear(16, 3, name="head")(h)
        net.outputs(loss=SoftmaxCrossEntropy(name="xent")(logits, y))
        return net

    def global_batch(self, step):
        # step 4 is an epoch's short last batch: with 3 ranks, one has no sample (idle_step)
        return np.random.default_rng([7, step]).permutation(len(self.x))[:2 if step == 4 else 12]

    def feeds(self, net, index, step, part):
        return {"x": self.x[index], "y": self.y[index]}


class Language:
    """The shipped language model (sparse embedding and selective-layer gradients) on source
    code chunks; 6 chunks of 24 tokens per global batch, 32 sampled negatives per token."""

    bucket_mb = 0.25

    def __init__(self):
        tok = language.tokenizer(self.network())
        self.chunks = language.chunk(tok.encode(Path(language.__file__).read_text()), 24)

    def network(self):
        return lm.load(MODELS / "python_lm" / "model.lamina")

    def global_batch(self, step):
        return np.random.default_rng([8, step]).permutation(len(self.chunks))[:6]

    def feeds(self, net, index, step, part):
        rng = np.random.default_rng([9, step, part])
        return language.training_feeds(net, [self.chunks[i] for i in index], 32, rng)


class Denoiser:
    """The shipped volumetric denoiser on synthetic volumes of 16³; 4 volumes per global batch."""

    bucket_mb = 0.05

    def __init__(self):
        rng = np.random.default_rng(3)
        self.clean = denoise.shapes(16, rng, size=16)
        self.noisy = denoise.noisy_copy(self.clean, rng)

    def network(self):
        shipped = lm.load(MODELS / "denoise3d" / "model.lamina")
        net = denoise.build(size=16)
        for (_, p), (_, q) in zip(net.named_parameters(), shipped.named_parameters()):
            p.assign(q.value)
        return net

    def global_batch(self, step):
        return np.random.default_rng([10, step]).permutation(len(self.clean))[:4]

    def feeds(self, net, index, step, part):
        return {"noisy": self.noisy[index], "clean": self.clean[index]}


class Lookup:
    """An embedding of 40 rows under a classifier; a global batch of 80 ids touches most rows
    and ranks overlap, so after the first step the rows gathered outnumber the table and the
    embedding's gradient is summed densely, with the union of rows kept (the lazy optimizer
    still updates exactly those). Ids of the global batch never use rows 35..39."""

    bucket_mb = 0.001

    def __init__(self):
        rng = np.random.default_rng(4)
        self.ids = rng.integers(0, 35, 600).astype(np.int32)
        self.y = (self.ids % 3).astype(np.int32)

    def network(self):
        net = lm.Network()
        ids, y = net.input("ids", dtype="int32"), net.input("y", dtype="int32")
        h = Embedding(40, 5, name="table")(ids)
        net.outputs(loss=SoftmaxCrossEntropy(name="xent")(Linear(5, 3, name="head")(h), y))
        return net

    def global_batch(self, step):
        return np.random.default_rng([11, step]).permutation(len(self.ids))[:80]

    def feeds(self, net, index, step, part):
        return {"ids": self.ids[index], "y": self.y[index]}


class Mixed:
    """A selective output layer of 20 columns whose backward takes its dense path on rank 0
    (8 columns a row: density 0.4) and its sparse path on the others (2 columns a row: 0.1), so
    one rank's gradient is dense and the others' are rows: all must still start the same
    collectives."""

    bucket_mb = 0.001

    def __init__(self):
        rng = np.random.default_rng(5)
        self.x = rng.standard_normal((200, 4)).astype(np.float32)
        self.y = rng.integers(0, 20, 200).astype(np.int32)
        self.negatives = rng.integers(0, 20, (200, 7)).astype(np.int32)

    def network(self):
        net = lm.Network()
        x, y, sel = net.input("x", 4), net.input("y", dtype="int32"), net.input("sel", dtype="selection")
        scores = SelectiveLinear(6, 20, name="output")(Linear(4, 6, activation="tanh", name="hidden")(x), sel)
        net.outputs(loss=SelectedCrossEntropy(name="xent")(scores, y, sel))
        return net

    def global_batch(self, step):
        return np.random.default_rng([12, step]).permutation(len(self.x))[:8]

    def feeds(self, net, index, step, part):
        width = 7 if part == 0 else 1
        columns = [np.r_[self.y[i], self.negatives[i, :width]] for i in index]
        return {"x": self.x[index], "y": self.y[index], "sel": lm.Selection.from_lists(columns)}


CASES = {"classifier": Classifier, "language": Language, "denoiser": Denoiser, "lookup": Lookup, "mixed": Mixed}
