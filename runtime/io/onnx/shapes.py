"""Shape arithmetic that involves the batch or time size, and the values whose axes move.

Exported sequence models compute shapes at run time: `Shape` of a value, `Gather`/`Slice`/
`Concat`/`Unsqueeze`/`Mul` of the result, then `Reshape`, `ConstantOfShape` or `Expand` with it.
Here such a shape is a Symbolic: an object array of ints and the names "N" (batch) and "T"
(time), folded like constants. A tensor of zeros whose shape holds those names (the usual zero
initial state of a recurrent layer) is Zeros. Transpose, Squeeze and Reshape of a lamina value
re-label its ONNX axes (`onnx_axes`: "N", "T", or k for lamina's per-sample or per-step axis k)
where no data moves, and refuse where it would.
"""
import math

import numpy as np

from ... import layers as L
from .registry import Refused, default_axes, onnx_shape


class Symbolic:
    """A 0-d or 1-d shape tensor whose entries are ints or the names "N" and "T"."""

    def __init__(self, values):
        self.values = np.array(values, dtype=object)

    def __repr__(self):
        return f"Symbolic({self.values.tolist()})"


class Zeros:
    """A tensor of zeros of a shape that involves the batch or time size."""


class PerPosition:
    """A constant with an axis over the time steps: a buffer sliced to the sequence's length
    (BERT's position ids and token types, `buffer[:, :T]`). `values` holds it at the buffer's
    full length; at time size T it is the first T entries along `axis`. Where it has a batch
    axis (`batch`: size 1 in `values`), every sample's entries are alike."""

    def __init__(self, values, axis, batch=None):
        self.values, self.axis, self.batch = np.asarray(values), axis, batch

    @property
    def length(self):
        return self.values.shape[self.axis]

    def at(self, t, n=1):
        out = np.take(self.values, np.arange(t), axis=self.axis)
        return out if self.batch is None else np.repeat(out, n, axis=self.batch)


class MaskOnes:
    """An attention mask read outside the attention (a mean pooling's weights): over a packed
    batch it is ones [N, T] (then `extra` axes of size 1), sequences holding no padding."""

    def __init__(self, extra=0):
        self.extra = extra


class BatchOrder:
    """An order of the batch's rows computed at run time (operators/sorting.py): "sorted" (TopK's
    indices, sorting the batch by a per-sample value: PyTorch's
    pack_padded_sequence(enforce_sorted=False) sorts by length), "inverse" (the order that undoes
    it) or "identity" (Range(0, N))."""

    def __init__(self, kind):
        self.kind = kind


class SortedLengths:
    """A per-sample value (each sequence's length) in the "sorted" BatchOrder."""

    def __init__(self, value):
        self.value = value


class Lengths:
    """Each sequence's length, the sum of a mask over the time axis: [N] then `extra` axes of size 1."""

    def __init__(self, extra=0):
        self.extra = extra


def _mask_op(imp, node, inputs, attrs):
    """Operators on a mask outside the attention and on the lengths summed from it."""
    op, x = node.op_type, inputs[0]
    if op in ("Cast", "Identity"):
        return [x]
    if op == "Unsqueeze" and isinstance(x, MaskOnes):
        axes = constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs["axes"]
        rank = 2 + x.extra + len(axes)
        if any((a + rank if a < 0 else a) < 2 for a in axes):
            raise Refused(f"axes {axes} of an attention mask: new axes before its batch and time axes")
        return [MaskOnes(x.extra + len(axes))]
    if op == "ReduceSum" and isinstance(x, MaskOnes):
        axes = constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
        if [a + 2 + x.extra if a < 0 else a for a in (axes or [])] != [1]:
            raise Refused(f"a sum of an attention mask over axes {axes} (lamina takes the sum over time: the lengths)")
        return [Lengths(x.extra + (1 if attrs.get("keepdims", 1) else 0))]
    if op in ("Clip", "Max") and isinstance(x, Lengths):  # a floor at or below 1: lengths are at least 1
        bounds = [v for v in inputs[1:] if v is not None]
        if all(isinstance(b, np.ndarray) and b.size == 1 for b in bounds) and \
                (op == "Max" or len(bounds) < 2) and all(float(b.reshape(())) <= 1 for b in bounds[:1]):
            return [x]
    raise Refused(f"{op} of an attention mask outside the attention (lamina's sequences hold no padding: it "
                  f"takes the mask's sum over time, and its product with the sequence)")


def constant_ints(x, what):
    if not isinstance(x, np.ndarray):
        raise Refused(f"{what} must be a constant")
    return [int(i) for i in np.atleast_1d(x)]


def entries(x):
    """A shape tensor's entries (ints, and "N" / "T" for a Symbolic) as an object array."""
    return x.values if isinstance(x, Symbolic) else np.asarray(x, dtype=object)


def factors(e):
    """(whole factor, names) of a shape entry: 4 -> (4, ()), "N" -> (1, ("N",)), "4*N*T" -> (4, ("N", "T"))."""
    if not isinstance(e, str):
        return int(e), ()
    parts = e.split("*")
    return math.prod(int(p) for p in parts if p.isdigit()), tuple(sorted(p for p in parts if not p.isdigit()))


def product(whole, names):
    """The shape entry whole x names (an int where no name is left): products of the batch or
    time size with others ("4*N": PyTorch's heads folded into the batch axis) stay symbolic."""
    if not names or whole == 0:
        return whole
    return "*".join(([str(whole)] if whole != 1 else []) + sorted(names))


def size_of(e, sizes):
    """A shape entry's number with the batch and time sizes at `sizes` ({"N": n, "T": t})."""
    whole, names = factors(e)
    return whole * math.prod(sizes[n] for n in names)


def _equal(a, b):
    """a == b for shape entries, where it is known whatever the batch and time sizes (>= 1)."""
    if not isinstance(a, str) and not isinstance(b, str):
        return int(a) == int(b)
    if isinstance(a, str) and isinstance(b, str) and factors(a) == factors(b):
        return True
    if (not isinstance(a, str) and int(a) < 1) or (not isinstance(b, str) and int(b) < 1):
        return False
    raise Refused(f"Equal of the batch or time size and another size ({a}, {b}): it depends on the batch")


def _mul(a, b):
    (x, m), (y, n) = factors(a), factors(b)
    return product(x * y, m + n)


def _div(a, b):
    """a / b where it is whole: (4*N) / 4 = N, (N*T) / T = N."""
    (x, m), (y, n) = factors(a), factors(b)
    left = list(m)
    for name in n:
        if name not in left:
            raise Refused(f"Div of the batch or time size ({a} / {b}) that does not divide it")
        left.remove(name)
    if y == 0 or x % y:
        raise Refused(f"Div of the batch or time size ({a} / {b}) that does not divide it")
    return product(x // y, tuple(left))


def shape(imp, node, inputs, attrs):
    x = inputs[0]
    dims = onnx_shape(imp, x)
    start, end = attrs.get("start", 0), attrs.get("end", len(dims))
    return [Symbolic(dims[slice(start, end)])]


def symbolic(imp, node, inputs, attrs):
    """An operator on shape tensors, zeros, or constants over the time steps (see the module
    docstring)."""
    op = node.op_type
    if inputs and isinstance(inputs[0], (MaskOnes, Lengths)):
        return _mask_op(imp, node, inputs, attrs)
    if op == "Slice" and isinstance(inputs[0], np.ndarray) and isinstance(inputs[2], Symbolic) and \
            list(inputs[2].values.ravel()) == ["T"]:
        return [_to_time_size(inputs, attrs)]
    if any(isinstance(v, PerPosition) for v in inputs):
        return _per_position_op(imp, node, inputs)
    if any(isinstance(v, Zeros) for v in inputs):
        if op in ("Slice", "Squeeze", "Unsqueeze", "Transpose", "Identity", "Cast"):
            return [Zeros()]
        raise Refused(f"{op} of a zero tensor whose shape holds the batch or time size")
    if op == "ConstantOfShape":
        fill = attrs.get("value")
        if fill is not None and np.any(imp.onnx.numpy_helper.to_array(fill)):
            raise Refused("ConstantOfShape of a non-zero value with the batch or time size")
        return [Zeros()]
    if op == "Expand":
        if not isinstance(inputs[0], np.ndarray) or np.any(inputs[0]):
            raise Refused("Expand of a non-zero constant to a shape with the batch or time size")
        return [Zeros()]
    if op == "Range" and isinstance(inputs[1], Symbolic) and inputs[1].values.ndim == 0 and \
            inputs[1].values.item() == "N" and [np.ravel(inputs[k]).tolist() for k in (0, 2)] == [[0], [1]]:
        return [BatchOrder("identity")]  # 0, 1, ..., N - 1
    if op == "ReduceProd" and isinstance(inputs[0], Symbolic) and [e for e in np.ravel(inputs[0].values) if e != 1] == ["N"] \
            and (len(inputs) < 2 or inputs[1] is None) and not attrs.get("noop_with_empty_axes", 0):
        return [Symbolic("N" if not attrs.get("keepdims", 1) else ["N"] * max(inputs[0].values.ndim, 1))]
    if op == "Shape" and isinstance(inputs[0], Symbolic):  # the shape of a shape tensor is known
        return [np.array(inputs[0].values.shape, np.int64)[slice(attrs.get("start", 0), attrs.get("end"))]]
    vals = [entries(v) if v is not None else None for v in inputs]
    if op == "Equal":  # sizes are positive: N == -1 is false (PyTorch's expand checks for -1)
        a, b = np.broadcast_arrays(vals[0], vals[1])
        return [np.array([_equal(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1))]).reshape(a.shape)]
    if op == "Where" and isinstance(inputs[0], np.ndarray):
        c, a, b = np.broadcast_arrays(inputs[0].astype(bool), vals[1], vals[2])
        return [Symbolic(np.where(c, a, b))]
    if not any(isinstance(e, str) for v in vals if v is not None for e in np.ravel(v)):
        # sizes within a sample only (a channel count read by Shape): plain numbers, folded
        return imp.fold(node, [v.astype(np.int64) if v is not None else None for v in vals])
    if op in ("Identity", "Cast"):
        return [Symbolic(vals[0])]
    if op == "Gather":
        return [Symbolic(np.take(vals[0], constant_ints(inputs[1], "indices") if np.ndim(inputs[1]) else int(inputs[1]),
                                 axis=attrs.get("axis", 0)))]
    if op == "Unsqueeze":
        axes = constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs["axes"]
        out = vals[0]
        for a in sorted(axes):
            out = np.expand_dims(out, a)
        return [Symbolic(out)]
    if op == "Squeeze":
        return [Symbolic(vals[0].reshape(-1) if vals[0].ndim else vals[0])]
    if op == "Concat":
        return [Symbolic(np.concatenate([np.atleast_1d(v) for v in vals], axis=attrs.get("axis", 0)))]
    if op == "Slice":
        starts, ends = constant_ints(inputs[1], "starts"), constant_ints(inputs[2], "ends")
        steps = constant_ints(inputs[4], "steps") if len(inputs) > 4 and inputs[4] is not None else [1]
        if len(starts) != 1:
            raise Refused("a slice of a shape along more than one axis")
        n = len(vals[0])
        end = min(ends[0], n) if ends[0] >= 0 else ends[0]
        return [Symbolic(vals[0][slice(starts[0], end, steps[0])])]
    if op == "Mul":
        a, b = np.broadcast_arrays(vals[0], vals[1])
        return [Symbolic(np.array([_mul(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1))],
                                  dtype=object).reshape(a.shape))]
    if op == "Reshape":
        return [Symbolic(vals[0].reshape(constant_ints(inputs[1], "shape")))]
    if op == "Div":
        a, b = np.broadcast_arrays(vals[0], vals[1])
        return [Symbolic(np.array([_div(x, y) for x, y in zip(a.reshape(-1), b.reshape(-1))],
                                  dtype=object).reshape(a.shape))]
    if op in ("Add", "Sub"):  # the size itself: N + 0, N - 0
        a, b = np.broadcast_arrays(vals[0], vals[1])
        out = []
        for x, y in zip(a.reshape(-1), b.reshape(-1)):
            if isinstance(y, str) or (isinstance(x, str) and y != 0):
                raise Refused(f"{op} of the batch or time size ({x}, {y}) (lamina folds shapes that keep it whole)")
            out.append(x if isinstance(x, str) else (x + y if op == "Add" else x - y))
        return [Symbolic(np.array(out, dtype=object).reshape(a.shape))]
    raise Refused(f"{op} with the batch or time size among its inputs")


def _to_time_size(inputs, attrs):
    """data[..., :T, ...] of a constant: a PerPosition along that axis."""
    data = inputs[0]
    starts = constant_ints(inputs[1], "starts")
    axes = constant_ints(inputs[3], "axes") if len(inputs) > 3 and inputs[3] is not None else [0]
    steps = constant_ints(inputs[4], "steps") if len(inputs) > 4 and inputs[4] is not None else [1]
    if starts != [0] or steps != [1] or len(axes) != 1:
        raise Refused(f"a slice of a constant to the time size from {starts}, step {steps} (lamina takes the first "
                      f"T entries of one axis)")
    axis = axes[0] + data.ndim if axes[0] < 0 else axes[0]
    if not 0 <= axis < data.ndim or data.shape[axis] < 2:
        raise Refused(f"a slice to the time size along axis {axes[0]} of a constant of shape {list(data.shape)}")
    return PerPosition(data, axis)


def _per_position_op(imp, node, inputs):
    """An operator on constants over the time steps, evaluated at the buffers' full length L and
    at L - 1, and at batch sizes 1 and 2. An output whose size along one axis follows the length,
    and whose shorter form is the longer one's first entries along it, is a PerPosition; one
    whose size along an axis follows the batch size, every sample alike, has that batch axis."""
    if node.op_type == "Shape":
        x = inputs[0]
        dims = [("T" if k == x.axis else "N" if k == x.batch else n) for k, n in enumerate(x.values.shape)]
        attrs = imp.attributes(node)
        return [Symbolic(dims[slice(attrs.get("start", 0), attrs.get("end", len(dims)))])]
    if node.op_type in ("Gather", "GatherElements") and isinstance(inputs[0], Zeros) and \
            isinstance(inputs[1], PerPosition):  # entries of zeros are zeros
        return [PerPosition(np.zeros_like(inputs[1].values), inputs[1].axis, inputs[1].batch)]
    full = min(v.length for v in inputs if isinstance(v, PerPosition))
    results = {}
    for t, n in ((full, 1), (full - 1, 1), (full, 2)):
        vals = []
        for v in inputs:
            if isinstance(v, Zeros):
                raise Refused(f"{node.op_type} of zeros and a constant over the time steps")
            vals.append(v.at(t, n) if isinstance(v, PerPosition) else np.array(
                [size_of(e, {"N": n, "T": t}) for e in np.ravel(v.values)], np.int64).reshape(np.shape(v.values))
                if isinstance(v, Symbolic) else v)
        results[t, n] = imp.fold(node, vals)
    outs = []
    for base, short, wide in zip(results[full, 1], results[full - 1, 1], results[full, 2]):
        if not all(isinstance(r, np.ndarray) for r in (base, short, wide)):
            return list(results[full, 1])  # (the fold's refusal is recorded)
        time, batch = _follows(base, short, full), _follows(base, wide, 1)
        if time is False or batch is False:
            raise Refused(f"{node.op_type} of a constant over the time steps whose result does not follow them")
        outs.append(base if time is None and batch is None else PerPosition(base, time, batch))
    return outs


def _follows(base, other, size):
    """The axis along which `other` differs from `base` (size `size` in base): None where they are
    equal, False where they differ otherwise than by base's entries being other's first ones
    (time) or being each of other's (batch)."""
    if base.ndim != other.ndim:
        return False
    axes = [k for k in range(base.ndim) if base.shape[k] != other.shape[k]]
    if not axes:
        return None if np.array_equal(base, other) else False
    if len(axes) != 1 or base.shape[axes[0]] != size:
        return False
    k = axes[0]
    if other.shape[k] < size:  # time: base's first entries are other
        return k if np.array_equal(np.take(base, np.arange(other.shape[k]), axis=k), other) else False
    return k if all(np.array_equal(np.take(other, [i], axis=k), base) for i in range(other.shape[k])) else False


def transpose(imp, node, inputs, attrs):
    """Where only the batch (and time) axes move, a relabelling; where a sample's own axes change
    order, lamina's Transpose layer moves the data."""
    x = inputs[0]
    axes = imp.axes_of(x)
    perm = attrs.get("perm", list(range(len(axes)))[::-1])
    new = tuple(axes[p] for p in perm)
    order = [a for a in new if not isinstance(a, str)]  # lamina's axes in their new order
    if order == sorted(order):
        return [relabel(imp, x, new)]
    if x.spec.kind != "float":
        raise Refused(f"perm {list(perm)} moves {x.spec.kind} values within a sample")
    y = imp.add(L.Transpose(order), [x], node)
    labels = tuple(a if isinstance(a, str) else order.index(a) for a in new)
    if labels != default_axes(y.spec):
        y.onnx_axes = labels
    return [y]


def along(imp, x, axis, where):
    """Lamina's per-sample axis that ONNX axis `axis` of x is (negative counts from the end)."""
    layout = imp.axes_of(x)
    k = axis + len(layout) if axis < 0 else axis
    if not 0 <= k < len(layout):
        raise Refused(f"{where} {axis} of a rank-{len(layout)} tensor")
    if isinstance(layout[k], str):
        raise Refused(f"{where} {axis} is the {'batch' if layout[k] == 'N' else 'time'} axis (lamina computes "
                      f"within each sample)")
    return layout[k]


def moved(imp, x, perm):
    """x with its per-sample axes in the order perm (a Transpose layer; x itself for the
    identity); the caller labels what it returns."""
    return x if list(perm) == sorted(perm) else imp.net.add(L.Transpose(perm), [x])


def relabel(imp, x, axes):
    """x under other ONNX axes, no data moved: a new value (a copy), since x may be read under
    its own axes elsewhere."""
    if axes == imp.axes_of(x):
        return x
    y = imp.net.add(L.Reshape(x.spec.shape), [x])
    if axes != default_axes(y.spec):
        y.onnx_axes = axes
    return y


def squeeze(imp, node, inputs, attrs):
    x = inputs[0]
    axes = imp.axes_of(x)
    which = constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
    if which is None:
        raise Refused("Squeeze without axes")
    which = sorted(a + len(axes) if a < 0 else a for a in which)
    if any(isinstance(axes[a], str) or x.spec.shape[axes[a]] != 1 for a in which):
        raise Refused(f"squeezing axes {which} of {axes}: only per-sample axes of size 1")
    gone = {axes[a] for a in which}
    keep = [k for k in range(len(x.spec.shape)) if k not in gone]
    y = imp.net.add(L.Reshape(tuple(x.spec.shape[k] for k in keep) or (1,)), [x])
    renumber = {k: i for i, k in enumerate(keep)}
    new = tuple(a if isinstance(a, str) else renumber[a] for i, a in enumerate(axes) if i not in which)
    if not keep:  # a scalar per step: lamina keeps one axis of size 1
        raise Refused("squeezing every per-sample axis")
    if new != default_axes(y.spec):
        y.onnx_axes = new
    return [y]


def unsqueeze(imp, node, inputs, attrs):
    """New axes of size 1 among a value's per-sample axes (before, between or after the batch
    and time axes: only their labels say where)."""
    x = inputs[0]
    if x.spec.kind != "float":
        raise Refused(f"Unsqueeze of {x.spec.kind} values")
    axes = imp.axes_of(x)
    which = constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
    if which is None:
        raise Refused("Unsqueeze without axes")
    rank = len(axes) + len(which)
    which = sorted(a + rank if a < 0 else a for a in which)
    if len(set(which)) != len(which) or not all(0 <= a < rank for a in which):
        raise Refused(f"axes {which} for an output of rank {rank}")
    own = [a for a in axes if not isinstance(a, str)]
    if own != sorted(own):
        raise Refused(f"a value whose axes are {axes} (its own axes out of order)")
    placed = list(axes)
    for a in which:
        placed.insert(a, None)  # None: a new axis
    shape, labels = [], []
    for a in placed:
        if isinstance(a, str):
            labels.append(a)
        else:
            labels.append(len(shape))
            shape.append(1 if a is None else x.spec.shape[a])
    y = imp.add(L.Reshape(tuple(shape)), [x], node)
    if tuple(labels) != default_axes(y.spec):
        y.onnx_axes = tuple(labels)
    return [y]


def reshape_value(imp, node, inputs, attrs):
    """Reshape of a lamina value: the batch (and time) axes stay where they are; the per-sample
    (per-step) axes take the new sizes (-1 and 0 resolved)."""
    x, target = inputs
    axes = imp.axes_of(x)
    target = list(entries(target)) if isinstance(target, Symbolic) else [int(t) for t in target]
    names = [a for a in axes if isinstance(a, str)]
    lead = axes[:len(names)]
    if tuple(lead) != tuple(names):
        raise Refused(f"a reshape of a value whose axes are {axes} (per-sample axes before the batch axis)")
    head = target[:len(names)]
    for i, (want, name) in enumerate(zip(head, names)):
        # the axis by name, 0 (kept), its size where the inputs fix it, or -1 for a lone batch axis
        if want not in (name, 0, imp.static.get(name)) and not (want == -1 and "N" in names and len(names) == 1):
            raise Refused(f"shape {target}: the {'batch' if name == 'N' else 'time'} axis must stay in place")
    rest = [x.spec.shape[i] if s == 0 else s for i, s in enumerate(target[len(names):])]
    if any(isinstance(s, str) for s in rest):
        raise Refused(f"shape {target}: the batch or time size inside a sample")
    count = math.prod(x.spec.shape)
    if rest.count(-1) > 1:
        raise Refused(f"shape {target}: two axes of unknown size")
    if -1 in rest:
        known = math.prod(s for s in rest if s != -1)
        rest[rest.index(-1)] = count // known if known else 0
    if math.prod(rest) != count or not rest:
        raise Refused(f"shape {target} for samples of {list(x.spec.shape)}")
    y = imp.add(L.Reshape(tuple(rest)), [x], node)
    new = tuple(names) + tuple(range(len(rest)))
    if new != default_axes(y.spec):
        y.onnx_axes = new
    return [y]
