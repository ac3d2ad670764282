"""Lines of Python source classified by the statement they start, with a small transformer
encoder over each line's tokens. Used by models/line_kind/train.py, the demo and the tests.

Data: the standard library split of lamina.zoo.language (a file is held out by crc32 of its
path); the first line of every statement of every file that parses, stripped of its
indentation, labelled with the statement's kind (KINDS; `ast` decides). Tokens: lamina.text's
Python tokenizer, at most MAX_TOKENS per line.

The saved graph: inputs ids (a sequence of token ids per line) and label (int32, training);
outputs loss (cross-entropy, training) and logits (one row of len(KINDS) scores per line).
"""
import ast

import numpy as np

from .. import layers
from ..graph import Network
from ..sequence import Sequences
from ..text import UNK

KINDS = ("import", "assign", "augmented assign", "return", "if", "loop", "def", "class", "expression", "raise",
         "try/with", "other")
_KIND_OF = {ast.Import: "import", ast.ImportFrom: "import", ast.Assign: "assign", ast.AnnAssign: "assign",
            ast.AugAssign: "augmented assign", ast.Return: "return", ast.If: "if", ast.For: "loop",
            ast.AsyncFor: "loop", ast.While: "loop", ast.FunctionDef: "def", ast.AsyncFunctionDef: "def",
            ast.ClassDef: "class", ast.Expr: "expression", ast.Raise: "raise", ast.Try: "try/with",
            ast.With: "try/with", ast.AsyncWith: "try/with"}
MAX_TOKENS = 48


def labelled_lines(texts):
    """[(line, kind index)] for the first line of every statement of each text that parses."""
    out = []
    for text in texts:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        lines = text.splitlines()
        for node in ast.walk(tree):
            if isinstance(node, ast.stmt) and node.lineno <= len(lines):
                line = lines[node.lineno - 1].strip()
                if line:
                    out.append((line, KINDS.index(_KIND_OF.get(type(node), "other"))))
    return out


def encode(tok, lines):
    """Each line's token ids (at most MAX_TOKENS; a line with none is one unknown token)."""
    return [np.array(tok.encode(line)[:MAX_TOKENS] or [UNK], np.int32) for line in lines]


def build(vocab_size, width=64, heads=4, num_layers=2, dropout=0.1):
    net = Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    label = net.input("label", dtype="int32")
    h = layers.Embedding(vocab_size, width, name="embedding")(ids)
    h = layers.LayerNorm(width, name="embedding_norm")(layers.PositionalEmbedding(MAX_TOKENS, width, name="positions")(h))
    layer = layers.TransformerEncoderLayer(width, heads, 2 * width, dropout=dropout, activation="gelu")
    h = layers.TransformerEncoder(layer, num_layers, name="encoder")(h)
    logits = layers.Linear(width, len(KINDS), name="classifier")(layers.SequencePool("average", name="pool")(h))
    net.outputs(loss=layers.SoftmaxCrossEntropy(name="cost")(logits, label), logits=logits)
    return net


def feeds(ids, labels=None):
    out = {"ids": Sequences.from_list(ids)}
    if labels is not None:
        out["label"] = np.asarray(labels, np.int32)
    return out


def predict(net, ids, batch=1024):
    """The kind index of each encoded line."""
    kinds = [net.run(feeds(ids[i:i + batch]), ["logits"])["logits"].argmax(1) for i in range(0, len(ids), batch)]
    return np.concatenate(kinds) if kinds else np.zeros(0, np.int64)


def held_out_sample(held, count, seed=1):
    """`count` held-out (line, kind) pairs, drawn without replacement by a fixed seed."""
    order = np.random.default_rng(seed).permutation(len(held))[:count]
    return [held[i] for i in order]
