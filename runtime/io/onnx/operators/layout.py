"""ONNX's operators that select or rearrange a value's entries: Concat, Flatten, Reshape, Slice,
Split, Shape, Transpose, Squeeze, Unsqueeze and Gather (of a step, an entry, or an embedding's
rows)."""
import math

import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from ..registry import Refused, assign, bounded_sample, const, converter, default_axes, onnx_shape_text, text, value


@converter("Concat", attributes={"axis"})
def concat(imp, node, inputs, attrs):
    """Along lamina's first per-sample axis (features, or channels), wherever the ONNX layout
    puts it (the recurrent layers' states [D, N, H] concatenate along their axis 0)."""
    axes = [imp.axes_of(x) if isinstance(x, Value) else None for x in inputs]
    if any(a is None or a != axes[0] for a in axes):
        raise Refused("inputs that are not all lamina values of one layout")
    xs = list(inputs)
    for i, x in enumerate(xs):
        if x.spec.kind != "float":
            raise Refused(f"input {i} holds {x.spec.kind} values")
    layout = axes[0]
    k = shapes.along(imp, xs[0], attrs["axis"], "axis")
    rank = len(xs[0].spec.shape)
    if k and xs[0].spec.sequence:
        raise Refused(f"axis {attrs['axis']} of a sequence's steps (lamina concatenates their features)")
    front = [k] + [i for i in range(rank) if i != k]  # another axis is moved first and back
    layer = L.Concat() if rank == 1 else L.ConcatChannels()
    out = imp.add(layer, [shapes.moved(imp, x, front) for x in xs], node)
    out = shapes.moved(imp, out, [front.index(i) for i in range(rank)])
    if layout != default_axes(out.spec):
        out.onnx_axes = layout
    return [out]


@converter("Flatten", attributes={"axis"})
def flatten(imp, node, inputs, attrs):
    x = value(inputs[0], "input")
    if attrs.get("axis", 1) != 1:
        raise Refused(f"axis {attrs.get('axis')} (only axis 1 keeps the batch axis apart)")
    return [imp.add(L.Reshape((math.prod(x.spec.shape),)), [x], node)]


@converter("Reshape", attributes={"allowzero"})
def reshape(imp, node, inputs, attrs):
    if not isinstance(inputs[0], Value):
        raise Refused("data must depend on the model's inputs")
    if inputs[0].spec.kind != "float":
        raise Refused("data holds integers")
    if attrs.get("allowzero", 0) and isinstance(inputs[1], np.ndarray) and 0 in inputs[1]:
        raise Refused("allowzero=1 with a zero in the shape")
    if not isinstance(inputs[1], (np.ndarray, shapes.Symbolic)):
        raise Refused("the shape must be a constant or computed from shapes")
    return shapes.reshape_value(imp, node, inputs, attrs)


@converter("Slice")
def slice_(imp, node, inputs, attrs):
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("data must be a float value computed from the model's inputs")
    starts, ends = (const(v, n) for v, n in zip(inputs[1:3], ("starts", "ends")))
    axes = const(inputs[3], "axes") if len(inputs) > 3 and inputs[3] is not None else np.arange(len(starts))
    steps = const(inputs[4], "steps") if len(inputs) > 4 and inputs[4] is not None else np.ones(len(starts))
    if len(starts) != 1 or int(steps[0]) != 1:
        raise Refused(f"a slice along axes {axes.tolist()} with steps {steps.tolist()}: lamina slices one axis, "
                      f"step 1")
    return [_sample_slice(imp, node, x, int(axes[0]), int(max(starts[0], -2**31)), int(min(ends[0], 2**31)),
                          squeeze=False)]


@converter("Split", attributes={"axis", "num_outputs", "split"})
def split(imp, node, inputs, attrs):
    """Consecutive parts of a sample's axis (ShuffleNet's channel halves, torch.chunk): a Slice
    layer each. The sizes come from the split input or attribute, else num_outputs (or the
    number of outputs) parts, the last one smaller where the axis does not divide (as ONNX)."""
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("input must be a float value computed from the model's inputs")
    axis = attrs.get("axis", 0)
    size = x.spec.shape[shapes.along(imp, x, axis, "axis")]
    given = inputs[1] if len(inputs) > 1 and inputs[1] is not None else attrs.get("split")
    if given is not None:
        sizes = shapes.constant_ints(np.asarray(given) if isinstance(given, list) else given, "split")
    else:
        parts = attrs.get("num_outputs", len(node.output))
        step = -(-size // parts)
        sizes = [min(step, size - k * step) for k in range(parts)]
    if len(sizes) != len(node.output) or sum(sizes) != size or min(sizes) < 0:
        raise Refused(f"parts {sizes} of an axis of {size} into {len(node.output)} outputs")
    outs, start = [], 0
    for name, n in zip(node.output, sizes):
        outs.append(_sample_slice(imp, node, x, axis, start, start + n, squeeze=False) if name else None)
        start += n
    return outs


@converter("DepthToSpace", "SpaceToDepth", attributes={"blocksize", "mode"})
def depth_space(imp, node, inputs, attrs):
    """Channels to blocks of the plane (DepthToSpace; PyTorch's pixel shuffle is its CRD mode) or
    back (SpaceToDepth), as Reshape, Transpose and Reshape of each sample [C, H, W]."""
    x = value(inputs[0], "input")
    if x.spec.sequence or len(x.spec.shape) != 3:
        raise Refused(f"input must be [N, C, H, W], found {onnx_shape_text(imp, x)}")
    b, (c, h, w) = attrs["blocksize"], x.spec.shape
    mode = text(attrs, "mode", "DCR")
    if b < 1 or mode not in ("DCR", "CRD"):
        raise Refused(f"blocksize {b}, mode {mode!r}")
    if node.op_type == "DepthToSpace":
        if c % (b * b):
            raise Refused(f"{c} channels in blocks of {b} x {b}")
        split, perm = ((b, b, c // (b * b), h, w), (2, 3, 0, 4, 1)) if mode == "DCR" else \
            ((c // (b * b), b, b, h, w), (0, 3, 1, 4, 2))
        out = (c // (b * b), h * b, w * b)
    else:
        if h % b or w % b:
            raise Refused(f"a plane of {h} x {w} in blocks of {b}")
        split, out = (c, h // b, b, w // b, b), (c * b * b, h // b, w // b)
        perm = (2, 4, 0, 1, 3) if mode == "DCR" else (0, 2, 4, 1, 3)
    y = imp.net.add(L.Transpose(perm), [imp.net.add(L.Reshape(split), [x])])
    return [imp.add(L.Reshape(out), [y], node)]


@converter("Tile")
def tile(imp, node, inputs, attrs):
    """A value repeated along its own axes: each axis wrapped around to its repeated length (lamina's
    Pad, mode wrap); the batch (and time) axes are not repeated."""
    x = value(inputs[0], "input")
    repeats = shapes.constant_ints(inputs[1], "repeats")
    layout = imp.axes_of(x)
    if len(repeats) != len(layout) or min(repeats) < 1:
        raise Refused(f"repeats {repeats} for a rank-{len(layout)} value")
    pads = [(0, 0)] * len(x.spec.shape)
    for axis, r in zip(layout, repeats):
        if isinstance(axis, str):
            if r != 1:
                raise Refused(f"repeats {repeats}: the {'batch' if axis == 'N' else 'time'} axis repeated")
            continue
        pads[axis] = (0, x.spec.shape[axis] * (r - 1))
    bounded_sample([n + a for n, (_, a) in zip(x.spec.shape, pads)], "an output")
    return [imp.add(L.Pad(pads, mode="wrap"), [x], node)]


converter("Shape", attributes={"start", "end"})(shapes.shape)
converter("Transpose", attributes={"perm"})(shapes.transpose)
converter("Squeeze", attributes={"axes"})(shapes.squeeze)
converter("Unsqueeze", attributes={"axes"})(shapes.unsqueeze)


def _sample_slice(imp, node, x, axis, start, stop, squeeze):
    """x[start:stop] along ONNX axis `axis`, which must be lamina's first per-sample axis (in
    whatever layout the value has); squeeze drops that axis (a Gather of one index)."""
    layout = imp.axes_of(x)
    if shapes.along(imp, x, axis, "axis") != 0:
        raise Refused(f"axis {axis} of a value whose axes are {layout} (lamina slices a sample's first axis)")
    size = x.spec.shape[0]
    start, stop = (min(max(b + size if b < 0 else b, 0), size) for b in (start, stop))
    if start >= stop:
        raise Refused(f"an empty slice {start}:{stop} of {size}")
    y = imp.add(L.Slice(start, stop, squeeze=squeeze), [x], node)
    if squeeze:
        if len(x.spec.shape) == 1:
            raise Refused("taking one entry of a value of one axis (lamina keeps an axis per sample)")
        new = tuple(a if isinstance(a, str) else a - 1 for a in layout if a != 0)
    else:
        new = layout
    if new != default_axes(y.spec):
        y.onnx_axes = new
    return y


def _is_time_axis(imp, x, axis):
    layout = imp.axes_of(x)
    return x.spec.sequence and -len(layout) <= axis < len(layout) and layout[axis] == "T"


def _time_step(imp, node, x, index):
    """Step `index` of every sequence (a Gather along the time axis): the first (0) or the last
    (-1, or the fixed time size less one: each sequence's own last step, the padded position T - 1
    where every sequence has length T)."""
    last = imp.static.get("T")
    if index == 0:
        mode = "first"
    elif index == -1 or (last is not None and index == last - 1):
        mode = "last"
    else:
        raise Refused(f"step {index} of every sequence (lamina takes the first or the last step)")
    y = imp.add(L.SequencePool(mode), [x], node)
    layout = tuple(a for a in imp.axes_of(x) if a != "T")
    if layout != default_axes(y.spec):
        y.onnx_axes = layout
    return y


@converter("Gather", attributes={"axis"})
def gather(imp, node, inputs, attrs):
    table, ids = inputs
    if isinstance(table, Value) and isinstance(ids, np.ndarray):  # one entry of a value's axis
        if table.spec.kind != "float" or ids.ndim != 0:
            raise Refused(f"indices {ids.tolist()} into a value: only a single index of a float value")
        index = int(ids)
        if _is_time_axis(imp, table, attrs.get("axis", 0)):
            return [_time_step(imp, node, table, index)]
        return [_sample_slice(imp, node, table, attrs.get("axis", 0), index, index + 1 if index != -1 else
                              table.spec.shape[0], squeeze=True)]
    table = const(table, "data (the embedding table)")
    ids = value(ids, "indices", kind="int32")
    if attrs.get("axis", 0) != 0 or table.ndim != 2:
        raise Refused("only rows of a 2-D table (axis 0), as an embedding")
    if ids.spec.kind != "int32" or ids.spec.shape != ():
        raise Refused(f"indices must be one integer per row, found {onnx_shape_text(imp, ids)}")
    layer = L.Embedding(table.shape[0], table.shape[1])
    assign(layer, "weight", table)
    return [imp.add(layer, [ids], node)]
