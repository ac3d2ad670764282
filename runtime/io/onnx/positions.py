"""Position ids that an exported encoder computes from its token ids.

RoBERTa numbers each token by counting the tokens before it that are not the padding id
(`cumsum(ids != pad) * (ids != pad) + pad`), and gathers its position (and token-type) embeddings
by those numbers. Within a sequence free of the padding id the numbers depend on the position
alone. `find` sets such index subgraphs aside (integer nodes computed from one sequence input
only, read as the indices of a Gather from a constant); `fold` evaluates one at the model's
fixed batch and time sizes on two random id batches that avoid every id the subgraph compares
with, and where both give the same numbers, the same in every sample, they are a constant:
the Gather then folds, and the Add of its result is a position embedding. The ids compared with
are the network's `onnx_reserved_ids`, which `lm.onnx.feeds` refuses inside a sequence.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .attention import evaluate
from .registry import Refused


@dataclass
class IndexSubgraph:
    output: str  # the index tensor
    source: str  # the sequence input of token ids it is computed from
    nodes: frozenset  # node indices
    reserved: tuple  # the constants the ids are compared with


def find(g, sequences, taken):
    """{node index: IndexSubgraph} for every node of the index subgraphs (see the module
    docstring) computed from the inputs in `sequences`, none of whose nodes is in `taken`."""
    found = {}
    for n in g.nodes:
        if n.op_type not in ("Gather", "GatherElements") or len(n.input) < 2 or not g.fixed(n.input[0]):
            continue
        index = n.input[1]
        if not g.dependent(index) or index in g.inputs or index in (s.output for s in found.values()):
            continue
        nodes, sources, stack = set(), set(), [index]
        while stack:
            t = stack.pop()
            if t in g.inputs:
                sources.add(t)
                continue
            i = g.made[t]
            if i not in nodes:
                nodes.add(i)
                stack.extend(x for x in g.nodes[i].input if x and g.dependent(x))
        if len(sources) != 1 or sources.isdisjoint(sequences) or nodes & set(taken) or nodes & set(found):
            continue
        inner = {o for k in nodes for o in g.nodes[k].output if o}
        readers = {c for t in inner for c in g.consumers.get(t, [])} - nodes
        if inner & g.outputs or any(g.nodes[c].op_type not in ("Gather", "GatherElements") or
                                    g.nodes[c].input[1] != index or not g.fixed(g.nodes[c].input[0]) for c in readers):
            continue
        source = sources.pop()
        reserved = tuple(sorted({x for k in nodes if g.nodes[k].op_type == "Equal"
                                 for x in g.nodes[k].input if x and g.fixed(x)}))
        sub = IndexSubgraph(index, source, frozenset(nodes), reserved)
        found.update((k, sub) for k in nodes)
    return found


def fold(imp, sub):
    """The index subgraph's output as a constant (see the module docstring), or Refused."""
    n, t = imp.static.get("N"), imp.static.get("T")
    if n is None or t is None:
        raise Refused(f"position ids computed from '{sub.source}' with its batch or time size not fixed")
    reserved = set()
    for name in sub.reserved:
        v = imp.env.get(name)
        if not isinstance(v, np.ndarray):
            raise Refused(f"'{sub.source}' is compared with '{name}', which is not a constant")
        reserved.update(int(x) for x in np.ravel(v))
    elem = next(i for i in imp.graph.input if i.name == sub.source).type.tensor_type.elem_type
    dtype = imp.onnx.helper.tensor_dtype_to_np_dtype(elem)
    rng = np.random.default_rng(0)
    results = []
    for _ in range(2):
        ids = rng.integers(0, 1000, (n, t))
        while np.isin(ids, list(reserved)).any():
            ids = np.where(np.isin(ids, list(reserved)), rng.integers(0, 1000, (n, t)), ids)
        results.append(evaluate(imp, sub.nodes, {sub.source: ids.astype(dtype)}, [sub.output], {"N": n, "T": t},
                                f"position ids computed from '{sub.source}' and '{{}}', another computed value")[0])
    first = results[0]
    if not np.array_equal(first, results[1]) or first.ndim != 2 or first.shape != (n, t) or \
            not np.all(first == first[:1]):
        raise Refused(f"indices computed from the token ids '{sub.source}' that depend on the ids themselves, not "
                      f"only on each token's position")
    imp.reserved_ids.setdefault(sub.source, set()).update(reserved)
    return first
