"""A token-level language model of Python source: Embedding -> LSTM -> SelectiveLinear, trained
with sampled softmax, scoring and continuing code. Used by models/python_lm/train.py, the
`lamina` command and the demo.

The saved graph serves training and inference:
  inputs  ids (sequence of token ids), h0 and c0 ([1, hidden] per sequence: the LSTM's starting
          state), sel (a Selection: each step's label plus sampled negatives), next (the label
          of each step, the following token);
  outputs loss (sampled softmax cross-entropy; needs sel and next), logits (every step's scores
          over the whole vocabulary), nll (each step's negative log-likelihood of `next` under
          the full softmax: scoring a text; not part of the training loss), last and cell (the
          LSTM's state after each sequence).
Inference carries last/cell over to h0/c0, so continuing a prompt costs one step per token.
"""
import math
import sysconfig
import time
import zlib
from pathlib import Path

import numpy as np

from .. import layers
from ..graph import Network
from ..selection import sampled_selection
from ..sequence import Sequences
from ..text import PythonTokenizer


# parts of the standard library left out of the data: test suites, third-party packages, tools
SKIP = {"test", "tests", "idlelib", "site-packages", "dist-packages", "lib2to3", "__pycache__"}


def stdlib_split():
    """(training files, held-out files): every .py file of this Python's standard library
    outside SKIP, sorted; a file is held out when crc32 of its relative path is 0 mod 10."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        if SKIP & set(rel.parts):
            continue
        (held if zlib.crc32(str(rel).encode()) % 10 == 0 else train).append(p)
    return train, held


def read_texts(paths):
    """The text of each readable UTF-8 file."""
    texts = []
    for p in paths:
        try:
            texts.append(Path(p).read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            pass
    return texts


def build(vocab_size, embedding_dim=64, hidden_size=256):
    net = Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    h0 = net.input("h0", (1, hidden_size))
    c0 = net.input("c0", (1, hidden_size))
    sel = net.input("sel", dtype="selection")
    nxt = net.input("next", dtype="int32", sequence=True)
    emb = layers.Embedding(vocab_size, embedding_dim, name="embedding")(ids)
    states, last, cell = layers.LSTM(embedding_dim, hidden_size, name="lstm")(emb, h0, c0)
    out = layers.SelectiveLinear(hidden_size, vocab_size, name="output")
    loss = layers.SelectedCrossEntropy(name="sampled_softmax")(out(states, sel), nxt, sel)
    logits = out(states)
    nll = layers.SoftmaxCrossEntropy(name="score", objective=False)(logits, nxt)
    net.outputs(loss=loss, logits=logits, nll=nll, last=last, cell=cell)
    return net


def hidden_size(net):
    return net.layer("lstm").hidden_size


def tokenizer(net):
    return PythonTokenizer(net.assets["vocabulary"])


def zero_state(net, sequences):
    h = hidden_size(net)
    return np.zeros((sequences, 1, h), net.dtype)


def training_feeds(net, chunks, num_sampled, randomness, shared_negatives=False):
    """A training batch from token-id chunks (each predicts its own next tokens), scored
    against its label and `num_sampled` log-uniform negatives per token, drawn from each chunk's
    own generator (randomness.samples), or once for the whole global batch from its shared one
    (shared_negatives: the output layer's gradient then touches far fewer rows, which is what
    data-parallel training exchanges). `randomness`: a lamina.training.BatchRandomness, or one
    numpy Generator for all of it."""
    ids = Sequences.from_list([c[:-1] for c in chunks], np.int32)
    nxt = Sequences.from_list([c[1:] for c in chunks], np.int32)
    vocab = net.layer("output").out_features
    if isinstance(randomness, np.random.Generator):
        draws = {"rng": randomness}
    elif shared_negatives:
        draws = {"rng": randomness.shared}
    else:
        draws = {"row_generators": [(len(c) - 1, g) for c, g in zip(chunks, randomness.samples)]}
    sel = sampled_selection(nxt.values, vocab, num_sampled, "log_uniform", shared_negatives, **draws)
    z = zero_state(net, len(chunks))
    return {"ids": ids, "next": nxt, "sel": sel, "h0": z, "c0": z}


def chunk(ids, length):
    """Token ids cut into pieces of length + 1 (each piece's last token is only a label)."""
    return [np.asarray(ids[i:i + length + 1], np.int32) for i in range(0, len(ids) - 1, length)
            if len(ids[i:i + length + 1]) >= 2]


def perplexity(net, chunks, batch=64):
    """exp of the mean full-softmax cross-entropy of every next token in `chunks`."""
    total, count = 0.0, 0
    for i in range(0, len(chunks), batch):
        part = chunks[i:i + batch]
        ids = Sequences.from_list([c[:-1] for c in part], np.int32)
        z = zero_state(net, len(part))
        logits = net.run({"ids": ids, "h0": z, "c0": z}, ["logits"])["logits"].values.astype(np.float64)
        labels = np.concatenate([c[1:] for c in part])
        m = logits.max(1, keepdims=True)
        logp = logits[np.arange(len(labels)), labels] - (m[:, 0] + np.log(np.exp(logits - m).sum(1)))
        total -= logp.sum()
        count += len(labels)
    return math.exp(total / count)


def continue_code(net, prompt, tokens=40, top_k=5, temperature=0.8, seed=0):
    """Continue Python source: returns (prompt and continuation as source text, seconds per
    generated token). Samples from the top_k most likely tokens at `temperature` (top_k=1:
    greedy)."""
    tok = tokenizer(net)
    ids = tok.encode(prompt)
    while ids and ids[-1] == tok.index["<dedent>"]:  # tokenize closes open blocks at the end
        ids.pop()
    ids = ids or [tok.index["<nl>"]]
    rng = np.random.default_rng(seed)
    h = c = zero_state(net, 1)
    feed = np.asarray(ids, np.int32)
    out, start = [], time.perf_counter()
    for _ in range(tokens):
        seq = Sequences(feed, np.array([0, len(feed)], np.int32))
        r = net.run({"ids": seq, "h0": h, "c0": c}, ["logits", "last", "cell"])
        h, c = r["last"], r["cell"]
        logits = r["logits"].values[-1].astype(np.float64)
        logits[0] = -np.inf  # never emit <unk>
        best = np.argpartition(-logits, top_k - 1)[:top_k] if top_k > 1 else np.array([np.argmax(logits)])
        p = np.exp((logits[best] - logits[best].max()) / temperature)
        nxt = int(rng.choice(best, p=p / p.sum()))
        out.append(nxt)
        feed = np.array([nxt], np.int32)
    seconds = (time.perf_counter() - start) / tokens
    return tok.decode(ids + out), seconds
