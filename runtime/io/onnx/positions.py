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

from . import registry, shapes
from .attention import evaluate
from .registry import Refused


@dataclass
class IndexSubgraph:
    output: str  # the index tensor
    source: str  # the sequence input of token ids it is computed from
    nodes: frozenset  # node indices
    reserved: tuple  # the constants the ids are compared with
    readers: tuple = ()  # the Gather / GatherElements nodes indexing a constant by it


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
        readers = {c for c in readers if g.nodes[c].op_type != "Shape" or g.nodes[c].input[0] != index}
        if inner & g.outputs or any(g.nodes[c].op_type not in ("Gather", "GatherElements") or
                                    g.nodes[c].input[1] != index or not g.fixed(g.nodes[c].input[0]) for c in readers):
            continue
        source = sources.pop()
        reserved = tuple(sorted({x for k in nodes if g.nodes[k].op_type == "Equal"
                                 for x in g.nodes[k].input if x and g.fixed(x)}))
        sub = IndexSubgraph(index, source, frozenset(nodes), reserved, tuple(sorted(readers)))
        found.update((k, sub) for k in nodes)
    return found


def fold(imp, sub):
    """The index subgraph's output as a constant, or as a PerPosition where the time size is not
    fixed (see the module docstring), or Refused."""
    reserved = set()
    for name in sub.reserved:
        v = imp.env.get(name)
        if not isinstance(v, np.ndarray):
            raise Refused(f"'{sub.source}' is compared with '{name}', which is not a constant")
        reserved.update(int(x) for x in np.ravel(v))
    n, t = imp.static.get("N"), imp.static.get("T")
    if n is not None and t is not None:
        values = _positions(imp, sub, reserved, n, t)
    else:  # up to the length the indexed tables allow
        sizes = [r for r in (_rows(imp, imp.graph.node[k]) for k in sub.readers) if r is not None]
        if not sizes:
            raise Refused(f"position ids computed from '{sub.source}' index no constant of a known size")
        rows = min(sizes)
        probe = _positions(imp, sub, reserved, 2, rows)
        inside = np.flatnonzero((probe[0] < 0) | (probe[0] >= rows))
        length = int(inside[0]) if len(inside) else rows
        if length < 2:
            raise Refused(f"position ids computed from '{sub.source}' index past the tables from the first steps")
        values = probe[:, :length]
        if not np.array_equal(_positions(imp, sub, reserved, 2, length - 1), values[:, :-1]):
            raise Refused(f"position ids computed from '{sub.source}' that change with the sequence's length")
    imp.reserved_ids.setdefault(sub.source, set()).update(reserved)
    return values if n is not None and t is not None else shapes.PerPosition(values[:1], 1, batch=0)


def _rows(imp, node):
    """How many entries the constant a reader indexes has along the indexed axis; None for zeros
    of a shape that involves the batch size (any index reads a zero) and for a constant the
    importer has not reached yet (its size bounds the model's sequences as well)."""
    data = imp.env.get(node.input[0])
    if data is None or isinstance(data, shapes.Zeros):  # (not converted yet: a later node's)
        return None
    data = data.values if isinstance(data, shapes.PerPosition) else data
    if not isinstance(data, np.ndarray):
        raise Refused(f"position ids index '{node.input[0]}', which is not a constant")
    axis = imp.attributes(node).get("axis", 0)
    if not -data.ndim <= axis < data.ndim:
        raise Refused(f"position ids index axis {axis} of '{node.input[0]}', a constant of shape {list(data.shape)}")
    return data.shape[axis]


def _positions(imp, sub, reserved, n, t):
    """The subgraph's output [n, t] on two random id batches avoiding the reserved ids; Refused
    where they differ or a sample's differs from the first's, or where ids of that size would
    take more than registry.FOLD_LIMIT bytes."""
    if 8 * n * t > registry.FOLD_LIMIT:
        raise Refused(f"position ids computed from '{sub.source}' at the export's sizes (N={n}, T={t}): "
                      f"{8 * n * t:,} bytes of ids, more than the {registry.FOLD_LIMIT:,} lamina allows")
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
    if not np.array_equal(first, results[1]) or first.shape != (n, t) or not np.all(first == first[:1]):
        raise Refused(f"indices computed from the token ids '{sub.source}' that depend on the ids themselves, not "
                      f"only on each token's position")
    return first
