"""Element-wise subgraphs that compute one activation, as that activation.

PyTorch's TorchScript exporter writes GELU, at the opsets before ONNX's own Gelu, as Div, Erf,
Add, Mul, Mul (and its tanh form as Pow, Mul, Add, Mul, Tanh, Add, Mul, Mul): five to eight passes
over a feed-forward block's widest tensor where one will do, and one a product can fuse. Its
dynamo exporter writes softplus as Where(x > 20, x, Softplus(x)) (PyTorch's threshold, where
softplus(x) and x agree in float32). `find` anchors at each Erf, Tanh and Softplus and grows forward along single readers through element-wise
operators with scalar constants; each end it reaches, with its element-wise ancestors back to
one input x, is a candidate. The importer keeps the longest candidate that, evaluated on sample
values of x, equals GELU (exact or tanh) to 1e-6 of its scale, and converts the nodes one by one
where none does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ELEMENT_WISE = frozenset({"Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Pow", "Sqrt", "Neg", "Identity", "Softplus",
                          "Greater", "Where"})
ANCHORS = ("Erf", "Tanh", "Softplus")
FORMS = {"gelu": lambda x: 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2))),
         "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3))),
         "softrelu": lambda x: np.maximum(x, 0) + np.log1p(np.exp(-np.abs(x)))}
# the activations are compared on this range, to 1e-6 of its bound: wide enough that a branch
# (softplus's switch to x above its threshold, 20 in PyTorch) is where it is taken
SAMPLE_BOUND = 30.0


@dataclass
class Candidate:
    x: str
    output: str
    nodes: frozenset  # node indices


@dataclass
class Fusion:
    candidates: list  # longest first
    nodes: frozenset  # every node of the candidates
    last: int  # the node after which all are converted


def find(g, taken):
    """{node index: Fusion} for the nodes of every activation subgraph outside `taken`."""
    found = {}
    for i, n in enumerate(g.nodes):
        if n.op_type not in ANCHORS or i in taken or i in found:
            continue
        candidates, name = [], n.output[0]
        for _ in range(6):
            c = g.sole_consumer(name)
            if c is None or g.nodes[c].op_type not in ELEMENT_WISE or not _scalars_only(g, g.nodes[c]):
                break
            name = g.nodes[c].output[0]
            candidate = _candidate(g, name)
            if candidate is not None:
                candidates.append(candidate)
        candidates = [c for c in candidates if not c.nodes & set(taken) and not c.nodes & set(found)]
        if candidates:
            nodes = frozenset().union(*(c.nodes for c in candidates))
            fusion = Fusion(candidates[::-1], nodes, max(nodes))
            found.update((k, fusion) for k in nodes)
    return found


def _scalars_only(g, node):
    """Whether the node's fixed inputs are single numbers."""
    return all(g.dependent(x) or g.size(x) == 1 for x in node.input if x)


def _candidate(g, output):
    """The element-wise subgraph computing `output` from one input, or None."""
    nodes, sources, stack = set(), set(), [output]
    while stack:
        t = stack.pop()
        i = g.made.get(t)
        n = g.nodes[i] if i is not None else None
        if n is None or n.op_type not in ELEMENT_WISE or not _scalars_only(g, n):
            sources.add(t)
            continue
        if i not in nodes:
            nodes.add(i)
            stack.extend(x for x in n.input if x and g.dependent(x))
    if len(sources) != 1 or len(nodes) < 3:
        return None
    inner = {o for k in nodes for o in g.nodes[k].output if o and o != output}
    if inner & g.outputs or any(c not in nodes for t in inner for c in g.consumers.get(t, [])):
        return None
    return Candidate(sources.pop(), output, frozenset(nodes))


def activation_of(imp, candidate):
    """The activation ('gelu', 'gelu_tanh') the candidate computes, or None."""
    from .attention import evaluate
    from .registry import Refused
    x = np.linspace(-SAMPLE_BOUND, SAMPLE_BOUND, 6001, dtype=np.float32)
    try:
        y, = evaluate(imp, candidate.nodes, {candidate.x: x}, [candidate.output], {"N": 1, "T": 1}, "{}")
    except Refused:
        return None
    y = np.asarray(y, np.float64)
    if y.shape != x.shape:
        return None
    for kind, form in FORMS.items():
        if np.abs(y - form(x.astype(np.float64))).max() <= 1e-6 * SAMPLE_BOUND:
            return kind
    return None
