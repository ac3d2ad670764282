"""Self-attention subgraphs of exported encoders as lamina's MultiheadAttention.

Exporters write attention as many small operators: the projections (MatMul and Add, or Gemm),
the head split (Reshape and Transpose; for PyTorch's packed in_proj also Unsqueeze, Squeeze and
Gather), the scores (a MatMul of two computed values, scaled by constants before or after it), a
mask added to them (computed from an attention_mask input, or constant), Softmax, the weighted
sum (a second MatMul), the heads merged (Transpose, Reshape) and the output projection. Each
exporter orders the plumbing its own way, so it is not matched operator by operator:

- `find` (before conversion, on the graph's structure) anchors at each Softmax whose input comes
  from a MatMul of two computed values and whose output is the first operand of a MatMul, walks
  back from the three operands over plumbing operators to the projections of one input x, and
  forward from the weighted sum to the output projection and the first rank-3 tensor after it.
  The nodes that read the region's inner tensors (the scale computed from a Shape) join it; the
  nodes that compute the mask from a graph input are set aside.
- `build` (during conversion, when the region's last node is reached) evaluates the region and
  its mask on a random x at concrete sizes (the model's own where its shapes are fixed) with a
  prefix attention mask, reads the heads off the scores' size and the scale off the scores
  themselves, and keeps the region only where its output equals multi-head attention with the
  projections' weights (causal or not) on every row inside a sequence. The region becomes one
  MultiheadAttention layer; the mask input becomes the batch's lengths (`lm.onnx.feeds`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ... import layers as L
from ...graph import Value
from . import registry
from .registry import Refused, assign, onnx_shape_text

# operators that move, select or scale a projection's entries between it and the scores
PLUMBING = frozenset({"Reshape", "Transpose", "Unsqueeze", "Squeeze", "Gather", "Slice", "Split", "Identity", "Cast",
                      "Flatten", "Mul", "Div", "Expand"})
# operators between Softmax and the weighted sum (PyTorch's SDPA zeroes fully masked rows by IsNaN/Where)
AFTER_SOFTMAX = frozenset({"Cast", "Identity", "Dropout", "IsNaN", "Where"})
# operators between the output projection and the layer's rank-3 output
AFTER_OUTPUT = frozenset({"Reshape", "Transpose", "Identity", "Cast", "Squeeze", "Unsqueeze", "Flatten"})
# operators through which a region's input is traced back to the graph input holding its sequences
TOWARD_INPUT = frozenset({"Identity", "Cast", "Dropout", "Add", "Sub", "Mul", "Div", "LayerNormalization",
                          "RMSNormalization", "Transpose", "MatMul", "Gemm", "Relu", "Gelu", "Tanh"})
SIDE_LIMIT = 64  # nodes one side chain of a region (a scale read off a shape) may hold


@dataclass
class Projection:
    """x @ weight (+ bias), from MatMul (and Add) or Gemm; tensor names."""
    x: str
    weight: str
    bias: Optional[str]
    transposed: bool = False  # Gemm with transB=1: weight is [out, in]
    alpha: float = 1.0
    beta: float = 1.0
    nodes: tuple = ()


@dataclass
class Region:
    softmax: int  # node index
    x: str
    query: Projection
    key: Projection
    value: Projection
    out: Projection
    output: str  # the tensor the region ends at
    scores: str  # the Softmax's input
    nodes: list = field(default_factory=list)  # node indices, in graph order
    mask_tensors: list = field(default_factory=list)  # added to the scores, or selecting among them
    mask_nodes: list = field(default_factory=list)  # the mask's nodes that depend on graph inputs
    mask_inputs: frozenset = frozenset()  # graph inputs those nodes read: attention masks of ones and zeros
    id_masks: frozenset = frozenset()  # token ids the mask is computed from (ids == padding id)
    reserved: tuple = ()  # the constants the ids are compared with


class Inside:
    """The value of a tensor inside an absorbed attention region or its mask: only the region's
    own nodes read it."""


class Graph:
    """An ONNX graph's nodes with who makes and who reads each tensor, and which tensors depend on
    the inputs' values."""

    def __init__(self, graph):
        self.nodes = list(graph.node)
        self.made = {out: i for i, n in enumerate(self.nodes) for out in n.output if out}
        self.consumers = {}
        for i, n in enumerate(self.nodes):
            for name in n.input:
                if name:
                    self.consumers.setdefault(name, []).append(i)
        self.outputs = {o.name for o in graph.output}
        self.initializers = {t.name for t in graph.initializer}
        self.inputs = {i.name for i in graph.input if i.name not in self.initializers}
        self.rank, self.dims = {}, {}  # a tensor's rank, and its sizes (None where symbolic)
        for info in list(graph.value_info) + list(graph.output) + list(graph.input):
            t = info.type.tensor_type
            if t.HasField("shape"):
                self.rank[info.name] = len(t.shape.dim)
                self.dims[info.name] = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        self._dependent, self._derived = {}, {}
        self.sizes = {t.name: int(np.prod(t.dims)) for t in graph.initializer}
        for n in self.nodes:
            if n.op_type == "Constant" and n.attribute:
                a = n.attribute[0]
                self.sizes[n.output[0]] = (int(np.prod(a.t.dims)) if a.name == "value" else
                                           len(a.floats) or len(a.ints) if a.name in ("value_floats", "value_ints")
                                           else 1)

    def size(self, name):
        """How many entries a constant tensor holds (None where the graph does not say)."""
        return self.sizes.get(name)

    def dependent(self, name):
        """Whether a tensor's values depend on a graph input (a Shape's output does not)."""
        return self._reaches(name, self._dependent, through_shapes=False)

    def derived(self, name):
        """Whether a tensor depends on a graph input, its values or its shape (not a constant)."""
        return self._reaches(name, self._derived, through_shapes=True)

    def _reaches(self, name, memo, through_shapes):
        stack = [name]
        while stack:  # iterative: deep graphs must not exhaust Python's recursion
            t = stack.pop()
            if t in memo:
                continue
            i = self.made.get(t)
            if i is None or (not through_shapes and self.nodes[i].op_type in ("Shape", "Size")):
                memo[t] = t in self.inputs
                continue
            pending = [x for x in self.nodes[i].input if x and x not in memo]
            if pending:
                stack.append(t)
                stack.extend(pending)
                continue
            memo[t] = any(memo[x] for x in self.nodes[i].input if x)
        return memo[name]

    def node(self, name):
        i = self.made.get(name)
        return (i, self.nodes[i]) if i is not None else (None, None)

    def fixed(self, name):
        return bool(name) and not self.dependent(name)

    def sole_consumer(self, name):
        """The one node reading the tensor's values (a Shape of it aside), or None."""
        cs = [c for c in self.consumers.get(name, []) if self.nodes[c].op_type not in ("Shape", "Size")]
        return cs[0] if len(cs) == 1 and name not in self.outputs else None


def find(g):
    """(regions, node index -> region for every node a region absorbs, indices of mask nodes,
    {graph input: "NT"} for the inputs the regions' x come from) in a Graph."""
    regions, taken = [], {}
    for i, n in enumerate(g.nodes):
        if n.op_type != "Softmax" or i in taken:
            continue
        region = _region(g, i)
        if region is not None and not any(k in taken for k in region.nodes):
            regions.append(region)
            taken.update((k, region) for k in region.nodes)
    while True:  # each mask's nodes, with their shape readers; read only by masks and regions
        kept, ancestors = [], {id(r): _ancestors(g, r.mask_tensors, set(taken)) for r in regions}
        every = set(taken).union(*ancestors.values())
        for region in regions:
            nodes = _closed(g, ancestors[id(region)], every)
            if nodes is not None:
                region.mask_nodes = sorted(nodes)
                region.mask_inputs = frozenset(t for k in nodes for t in g.nodes[k].input if t in g.inputs)
                kept.append(region)
        masks = {k for r in kept for k in r.mask_nodes}
        if len(kept) == len(regions) and not masks & set(taken):
            break
        regions = [r for r in kept if not masks & set(r.nodes)]
        taken = {k: r for r in regions for k in r.nodes}
    sequences = {}
    for region in regions:
        for name in _sources(g, region.x):
            sequences.setdefault(name, "NT")
    for region in regions:  # a padding mask computed from the token ids themselves
        region.id_masks = region.mask_inputs & set(sequences)
        region.mask_inputs -= region.id_masks
        region.reserved = tuple(sorted({x for k in region.mask_nodes if g.nodes[k].op_type == "Equal"
                                        for x in g.nodes[k].input if g.fixed(x)})) if region.id_masks else ()
    return regions, taken, masks, sequences


def _region(g, softmax):
    node = g.nodes[softmax]
    if any(a.name == "axis" and a.i not in (-1, g.rank.get(node.input[0], 0) - 1) for a in node.attribute):
        return None
    scores = _score_chain(g, node.input[0])
    if scores is None:
        return None
    first, chain, mask_tensors = scores
    after = _after_softmax(g, node.output[0])
    if after is None:
        return None
    second, between = after
    paths = {}
    for role, start in (("query", g.nodes[first].input[0]), ("key", g.nodes[first].input[1]),
                        ("value", g.nodes[second].input[1])):
        found = _back_to_projection(g, start)
        if found is None:
            return None
        paths[role] = found
    xs = {p.x for p, _ in paths.values()}
    if len(xs) != 1:
        return None
    forward = _to_output(g, g.nodes[second].output[0])
    if forward is None:
        return None
    out, output, tail = forward
    core = {first, softmax, second} | set(chain) | set(between) | set(tail) | set(out.nodes)
    for p, plumbing in paths.values():
        core |= set(p.nodes) | set(plumbing)
    core = _closed(g, core, set(), keep=output)
    if core is None:
        return None
    return Region(softmax, xs.pop(), paths["query"][0], paths["key"][0], paths["value"][0], out, output,
                  node.input[0], sorted(core), mask_tensors)


def _score_chain(g, name):
    """From the Softmax's input back to the MatMul of two computed values: (its index, the nodes
    passed, the mask tensors added or selected on the way), or None."""
    chain, masks = [], []
    for _ in range(16):
        i, n = g.node(name)
        if n is None:
            return None
        chain.append(i)
        computed = [x for x in n.input if x and g.dependent(x)]
        if n.op_type == "MatMul":
            return (i, chain[:-1], masks) if len(computed) == 2 else None
        scaled = len(computed) == 1 and (n.op_type == "Mul" or  # by a constant, on either side
                                         n.op_type in ("Div", "Cast", "Identity") and n.input[0] == computed[0])
        if scaled:
            name = computed[0]
        elif n.op_type == "Add" and len(n.input) == 2:
            if len(computed) == 1:
                name = computed[0]  # a constant mask
            else:
                for a, b in (n.input, n.input[::-1]):
                    rest = _score_chain(g, a)
                    if rest is not None:
                        return rest[0], chain + rest[1], masks + [b] + rest[2]
                return None
        elif n.op_type == "Where" and len(n.input) == 3:
            branches = [x for x in n.input[1:] if g.dependent(x)]
            if len(branches) != 1:
                return None
            masks.append(n.input[0])
            name = branches[0]
        else:
            return None
    return None


def _after_softmax(g, name):
    """From the Softmax's output forward to the MatMul that weighs the values by it: (its index,
    the nodes between), or None."""
    reached, between, frontier, second = {name}, [], [name], None
    while frontier:
        t = frontier.pop()
        if t in g.outputs:
            return None
        for c in g.consumers.get(t, []):
            n = g.nodes[c]
            if n.op_type == "MatMul" and n.input[0] == t and n.input[1] not in reached:
                if second not in (None, c):
                    return None
                second = c
            elif n.op_type in AFTER_SOFTMAX and c not in between:
                if len(between) > 8:
                    return None
                between.append(c)
                reached.update(o for o in n.output if o)
                frontier.extend(o for o in n.output if o)
            elif n.op_type not in AFTER_SOFTMAX:
                return None
    return (second, between) if second is not None else None


def _projection(g, name):
    """The Projection producing `name` (MatMul of a computed value by a fixed one, plus a fixed
    bias; or Gemm), or None."""
    i, n = g.node(name)
    if n is None:
        return None
    if n.op_type == "Gemm" and len(n.input) >= 2 and g.dependent(n.input[0]) and g.fixed(n.input[1]) and \
            (len(n.input) < 3 or not n.input[2] or g.fixed(n.input[2])):
        attrs = {a.name: a for a in n.attribute}
        if "transA" in attrs and attrs["transA"].i:
            return None
        return Projection(n.input[0], n.input[1], n.input[2] if len(n.input) > 2 and n.input[2] else None,
                          bool(attrs["transB"].i) if "transB" in attrs else False,
                          attrs["alpha"].f if "alpha" in attrs else 1.0, attrs["beta"].f if "beta" in attrs else 1.0,
                          (i,))
    if n.op_type == "MatMul" and g.dependent(n.input[0]) and g.fixed(n.input[1]):
        return Projection(n.input[0], n.input[1], None, nodes=(i,))
    if n.op_type == "Add" and len(n.input) == 2:
        for a, b in (n.input, n.input[::-1]):
            j, m = g.node(a)
            if m is not None and m.op_type == "MatMul" and g.fixed(b) and g.sole_consumer(a) == i and \
                    g.dependent(m.input[0]) and g.fixed(m.input[1]):
                return Projection(m.input[0], m.input[1], b, nodes=(j, i))
    return None


def _back_to_projection(g, name):
    """(Projection, the plumbing nodes passed) from an operand of the scores or the weighted sum
    back over plumbing operators, or None."""
    passed = []
    for _ in range(24):
        p = _projection(g, name)
        if p is not None:
            return p, passed
        i, n = g.node(name)
        if n is None or n.op_type not in PLUMBING:
            return None
        computed = [x for x in n.input if x and g.dependent(x)]
        if len(computed) != 1:
            return None
        passed.append(i)
        name = computed[0]
    return None


def _to_output(g, name):
    """(the output Projection, the region's output tensor, the nodes passed) forward from the
    weighted sum: plumbing, the projection, then plumbing up to the first rank-3 tensor."""
    passed = []
    for _ in range(8):
        c = g.sole_consumer(name)
        if c is None:
            return None
        n = g.nodes[c]
        if n.op_type in ("MatMul", "Gemm") and n.input[0] == name:
            add = g.sole_consumer(n.output[0])
            p = _projection(g, g.nodes[add].output[0]) if add is not None else None
            if p is None or p.x != name:
                p = _projection(g, n.output[0])
            if p is None or p.x != name:
                return None
            end = g.nodes[p.nodes[-1]].output[0]
            while g.rank.get(end) != 3:
                c = g.sole_consumer(end)
                if c is None or g.nodes[c].op_type not in AFTER_OUTPUT or len(passed) > 16:
                    return None
                passed.append(c)
                end = g.nodes[c].output[0]
            return p, end, passed
        if n.op_type not in AFTER_OUTPUT:
            return None
        passed.append(c)
        name = n.output[0]
    return None


def _ancestors(g, tensors, regions):
    """The nodes computing the mask tensors: their ancestors that depend on a graph input, and
    those computed from shapes (a Range over the time size) that only masks and regions read;
    a Shape itself, and shape arithmetic read elsewhere, stay with the importer."""
    nodes, stack = set(), [t for t in tensors if g.derived(t)]
    while stack:
        i = g.made.get(stack.pop())
        if i is None or i in nodes:
            continue
        n = g.nodes[i]
        if n.op_type not in ("Shape", "Size"):
            nodes.add(i)
            stack.extend(x for x in n.input if x and g.derived(x))
        elif not g.dependent(n.input[0]):  # the shape of a mask's own shape arithmetic
            stack.append(n.input[0])
    while True:
        shared = {k for k in nodes if not any(g.dependent(o) for o in g.nodes[k].output if o) and
                  any(c not in nodes and c not in regions and g.nodes[c].op_type not in ("Shape", "Size")
                      for o in g.nodes[k].output if o for c in g.consumers.get(o, []))}
        if not shared:
            return nodes
        nodes -= shared


def _closed(g, members, stop, keep=None):
    """The members with every node that reads their tensors (but `keep`) and is not in `stop`:
    a shape read off one (the scale from a Shape of the queries, a mask's shape arithmetic) and
    what is computed from it. None where such a reader also reads another computed value, or a
    member's tensor is a graph output."""
    members = set(members)
    for _ in range(SIDE_LIMIT):
        inner = {o for k in members for o in g.nodes[k].output if o and o != keep}
        if inner & g.outputs:
            return None
        readers = {c for t in inner for c in g.consumers.get(t, []) if c not in members and c not in stop}
        if not readers:
            return members
        for c in readers:
            n = g.nodes[c]
            if n.op_type not in ("Shape", "Size") and any(g.dependent(x) and x not in inner for x in n.input if x):
                return None
        members |= readers
    return None


def _sources(g, name):
    """The graph inputs a region's x is computed from through embeddings and operators that keep
    the leading axes (a residual stream), whose first two axes are then batch and time."""
    found, seen, stack = [], set(), [name]
    while stack:
        t = stack.pop()
        if t in seen:
            continue
        seen.add(t)
        if t in g.inputs:
            if g.rank.get(t, 0) >= 2:
                found.append(t)
            continue
        i, n = g.node(t)
        if n is None:
            continue
        if n.op_type == "Gather" and g.fixed(n.input[0]):
            stack.append(n.input[1])  # an embedding's ids
        elif n.op_type in TOWARD_INPUT:
            stack.extend(x for x in n.input if x and g.dependent(x))
    return found


# ---------------------------------------------------------------------------------- building

def build(imp, region):
    """The MultiheadAttention layer a region computes, applied to its input (see the module
    docstring), or Refused."""
    x = imp.env.get(region.x)
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused(f"the attention's input '{region.x}' must be float values computed from the model's inputs")
    if not (x.spec.sequence and len(x.spec.shape) == 1) and not (not x.spec.sequence and len(x.spec.shape) == 2):
        raise Refused(f"attention over {onnx_shape_text(imp, x)}: lamina attends within sequences of rows "
                      f"([N, T, E] sequences, or [T, E] per sample)")
    E = x.spec.shape[-1]
    in_weight, in_bias = _in_projection(imp, region, E)
    out_weight, out_bias = _weights(imp, region.out, E, E, "the output projection")
    layout = imp.axes_of(x)
    if sorted(map(str, layout)) != (["0", "N", "T"] if x.spec.sequence else ["0", "1", "N"]) or \
            (not x.spec.sequence and layout != ("N", 0, 1)):
        raise Refused(f"attention over {onnx_shape_text(imp, x)} with its axes as {layout}")
    n = imp.static.get("N", 2)
    t = x.spec.shape[0] if not x.spec.sequence else imp.static.get("T", 5)
    _bounded(imp, region, n, t, E)
    lengths = np.full(n, t)
    if region.mask_inputs or region.id_masks:  # some sequences shorter than the padded length, to see the mask work
        lengths = np.maximum(1, t - np.arange(n) % 3) if n > 1 else np.array([max(1, t - 1)])
    sizes = {"N": n, "T": t}
    x_onnx = np.random.default_rng(0).standard_normal(
        [sizes[a] if isinstance(a, str) else x.spec.shape[a] for a in layout]).astype(np.float32)
    layout = layout if x.spec.sequence else ("N", "T", 0)
    batch_first = np.transpose(x_onnx, [layout.index(a) for a in ("N", "T", 0)])
    output, scores = _evaluate(imp, region, x_onnx, lengths, sizes)
    if scores.size % (n * t * t) or E % (scores.size // (n * t * t)):
        raise Refused(f"scores of shape {list(scores.shape)} are not [N, heads, T, T] with heads dividing {E}")
    heads = scores.size // (n * t * t)
    d = E // heads
    qkv = batch_first.astype(np.float64) @ in_weight.T + in_bias
    q, k = (qkv[..., i * E:(i + 1) * E].reshape(n, t, heads, d).transpose(0, 2, 1, 3) for i in (0, 1))
    raw = (q @ k.transpose(0, 1, 3, 2))[0, :, :lengths[0], :lengths[0]]
    seen = scores.reshape(n, heads, t, t)[0, :, :lengths[0], :lengths[0]]
    lower = np.tril(np.ones(raw.shape[-2:], bool))
    scale = float(np.sum(seen[:, lower] * raw[:, lower]) / max(np.sum(raw[:, lower] ** 2), 1e-30))
    valid = np.arange(t)[None, :] < lengths[:, None]
    err, found = np.inf, None
    if not _layouts(output, layout, n, t):
        raise Refused(f"the attention's output has shape {list(output.shape)}, not that of its input "
                      f"{list(x_onnx.shape)} in either order of the batch and time axes")
    for axes in _layouts(output, layout, n, t):
        got = np.transpose(output, [axes.index(a) for a in ("N", "T", 0)]).astype(np.float64)
        for causal in (False, True):
            want = _attention(qkv, lengths, heads, scale, causal) @ out_weight.T + out_bias
            diff = np.abs(got[valid] - want[valid]).max()
            if diff <= 1e-4 * max(np.abs(want[valid]).max(), 1e-3):
                found = axes, causal
                break
            err = min(err, diff)
        if found:
            break
    else:
        raise Refused(f"the subgraph around this Softmax is not multi-head self-attention of its input "
                      f"'{region.x}' (evaluated at N={n}, T={t}, {heads} heads, scale {scale:.6g}: the largest "
                      f"difference is {err:.3g})")
    axes, causal = found
    layer = L.MultiheadAttention(E, heads, bias=True, causal=causal)
    factor = scale * math.sqrt(d)  # the scale beyond 1/sqrt(d), folded into the query's weights
    in_weight, in_bias = in_weight.copy(), in_bias.copy()
    in_weight[:E] *= factor
    in_bias[:E] *= factor
    assign(layer, "in_proj_weight", in_weight)
    assign(layer, "in_proj_bias", in_bias)
    assign(layer, "out_proj.weight", out_weight)
    assign(layer, "out_proj.bias", out_bias)
    y = imp.add(layer, [x], imp.graph.node[region.softmax])
    if x.spec.sequence and axes != ("N", "T", 0):
        y.onnx_axes = axes
    imp.mask_inputs.update(region.mask_inputs)
    for name in region.id_masks:  # the padding id is no token inside a sequence (lm.onnx.feeds)
        imp.reserved_ids.setdefault(name, set()).update(_reserved_ids(imp, region))
    return y


def _bounded(imp, region, n, t, E):
    """Refused where checking the region at these sizes would hold more than registry.FOLD_LIMIT bytes in
    one tensor: its queries, keys and values, or its scores (their size as shape inference gives
    it, else one head per 8 features)."""
    dims = imp.attention_graph.dims.get(region.scores)
    scores = math.prod(dims) if dims and all(d for d in dims) else n * t * t * max(1, E // 8)
    largest = 4 * max(scores, 3 * n * t * E)
    if largest > registry.FOLD_LIMIT:
        raise Refused(f"checking this attention at the export's sizes (N={n}, T={t}) would hold {largest:,} bytes in "
                      f"one tensor, more than the {registry.FOLD_LIMIT:,} lamina allows; export with a smaller example input "
                      f"or with dynamic axes")


def _weights(imp, p, rows, cols, what):
    """(weight [cols, rows] as lamina's Linear holds it, bias [cols]) of a Projection."""
    w = imp.env.get(p.weight)
    b = imp.env.get(p.bias) if p.bias else np.zeros(cols)
    if not isinstance(w, np.ndarray) or not isinstance(b, np.ndarray):
        raise Refused(f"the weights of {what} must be constants")
    w = np.asarray(w, np.float64) * p.alpha
    w = w if p.transposed else w.T
    if w.shape != (cols, rows):
        raise Refused(f"{what} has weights of shape {list(w.shape)}, expected {[cols, rows]}")
    try:
        b = np.broadcast_to(np.asarray(b, np.float64) * p.beta, (cols,)).copy()
    except ValueError:
        raise Refused(f"{what} has a bias of shape {list(np.shape(b))}, expected [{cols}]") from None
    return w, b


def _in_projection(imp, region, E):
    """in_proj_weight [3E, E] and in_proj_bias [3E]: one packed projection (PyTorch's in_proj,
    query, key and value in that order) or three of the same input."""
    ps = (region.query, region.key, region.value)
    if ps[0].nodes == ps[1].nodes == ps[2].nodes:
        return _weights(imp, ps[0], E, 3 * E, "the packed input projection")
    if len({p.nodes for p in ps}) != 3:
        raise Refused("two of the query, key and value come from one projection and the third from another")
    parts = [_weights(imp, p, E, E, f"the {role} projection") for p, role in zip(ps, ("query", "key", "value"))]
    return np.concatenate([w for w, _ in parts]), np.concatenate([b for _, b in parts])


def _evaluate(imp, region, x, lengths, sizes):
    """(the region's output, the Softmax's input) over the region's and its mask's nodes, x and a
    prefix attention mask of the given lengths fed."""
    helper = imp.onnx.helper
    given = {region.x: x}
    inside = np.arange(sizes["T"])[None, :] < lengths[:, None]
    for name in region.mask_inputs | region.id_masks:
        elem = next(i for i in imp.graph.input if i.name == name).type.tensor_type.elem_type
        if name in region.mask_inputs:
            mask = inside
        else:  # token ids: random ones that are no padding id inside, a padding id past each end
            padding = _reserved_ids(imp, region)
            ids = np.random.default_rng(1).integers(0, 1000, inside.shape)
            while np.isin(ids, padding).any():
                ids = np.where(np.isin(ids, padding), np.random.default_rng(2).integers(0, 1000, inside.shape), ids)
            mask = np.where(inside, ids, padding[0])
        given[name] = mask.astype(helper.tensor_dtype_to_np_dtype(elem))
    return evaluate(imp, set(region.nodes) | set(region.mask_nodes), given, (region.output, region.scores), sizes,
                    f"the attention reads '{{}}', computed from the model's inputs, besides its input '{region.x}' "
                    f"and an attention mask")


def _reserved_ids(imp, region):
    """The ids a padding mask computed from the token ids compares them with."""
    found = []
    for name in region.reserved:
        v = imp.env.get(name)
        if isinstance(v, np.ndarray) and v.dtype.kind in "iu":
            found += [int(i) for i in np.ravel(v)]
    if not found:
        raise Refused(f"a mask computed from the token ids {sorted(region.id_masks)} otherwise than by comparing them "
                      f"with a padding id")
    return sorted(set(found))


def evaluate(imp, indices, given, outputs, sizes, unknown):
    """The outputs of the graph's nodes `indices` from onnx's reference evaluator: the arrays
    `given` fed, constants as folded, shapes with the batch and time sizes at `sizes`; reading
    any other value is Refused(unknown.format(name))."""
    from . import shapes
    from .evaluator import reference_evaluator
    helper = imp.onnx.helper
    nodes = [imp.graph.node[k] for k in sorted(indices)]
    made = {o for n in nodes for o in n.output if o}
    feeds = {}
    for name in (x for n in nodes for x in n.input if x and x not in made):
        v = imp.env.get(name)
        if name in given:
            feeds[name] = given[name]
        elif isinstance(v, np.ndarray):
            feeds[name] = v
        elif isinstance(v, shapes.Symbolic):
            feeds[name] = np.array([shapes.size_of(e, sizes) for e in np.ravel(v.values)],
                                   np.int64).reshape(np.shape(v.values))
        else:
            raise Refused(unknown.format(name))
    infos = [helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), None) for k, v in feeds.items()]
    model = helper.make_model(helper.make_graph(nodes, "part", infos, [helper.make_tensor_value_info(k, 0, None)
                                                                        for k in outputs]),
                              opset_imports=[helper.make_opsetid("", imp.opset)])
    try:
        return [np.asarray(r) for r in reference_evaluator(model).run(None, feeds)]
    except Exception as e:  # the reference evaluator raises what numpy raises
        raise Refused(f"could not evaluate the subgraph at N={sizes['N']}, T={sizes['T']} ({e}); where the "
                      f"model's inputs declare these sizes dynamic, the export may have fixed them") from None


def _layouts(output, layout, n, t):
    """The ONNX layouts an output of this shape may have: the input's, and the other order of the
    batch and time axes."""
    both = [tuple(layout), ("T", "N", 0) if tuple(layout)[:2] == ("N", "T") else ("N", "T", 0)]
    return [axes for axes in both if output.ndim == 3 and list(output.shape[:2]) == [{"N": n, "T": t}[a]
                                                                                   for a in axes[:2]]]


def _attention(qkv, lengths, heads, scale, causal):
    """Multi-head self-attention in float64 over the first lengths[n] rows of each sample of
    qkv [N, T, 3E] (rows past a length are zero)."""
    n, t, three_e = qkv.shape
    E = three_e // 3
    d = E // heads
    out = np.zeros((n, t, E))
    for s in range(n):
        m = lengths[s]
        q, k, v = (qkv[s, :m, i * E:(i + 1) * E].reshape(m, heads, d).transpose(1, 0, 2) for i in range(3))
        z = scale * q @ k.transpose(0, 2, 1)
        if causal:
            z = np.where(np.tril(np.ones((m, m), bool)), z, -np.inf)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[s, :m] = (p @ v).transpose(1, 0, 2).reshape(m, E)
    return out
