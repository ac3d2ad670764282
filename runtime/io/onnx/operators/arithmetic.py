"""ONNX's arithmetic on values: Add, Sub, Mul, Div, Expand and Pow."""
import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from ..registry import Refused, assign, bias_of, const, converter, default_axes, onnx_shape_text, value


def _operands(imp, inputs):
    """The two operands of an element-wise node: values must hold floats; two values of different
    shapes broadcast (lamina's Broadcast layer) when they have one rank and each axis of size 1
    where they differ (a channel's weight over its plane: squeeze-and-excitation)."""
    for i, x in enumerate(inputs):
        if isinstance(x, Value):
            value(x, f"input {i}")
    a, b = inputs
    if isinstance(a, Value) and isinstance(b, Value) and a.spec != b.spec:
        sa, sb = a.spec.shape, b.spec.shape
        if a.spec.sequence != b.spec.sequence or len(sa) != len(sb) or \
                any(x != y and 1 not in (x, y) for x, y in zip(sa, sb)):
            raise Refused(f"operands of shapes {onnx_shape_text(imp, a)} and {onnx_shape_text(imp, b)} (lamina "
                          f"broadcasts between two inputs of one rank, batch axes alike)")
        target = tuple(max(x, y) for x, y in zip(sa, sb))
        try:
            a, b = (x if x.spec.shape == target else imp.net.add(L.Broadcast(target), [x]) for x in (a, b))
        except ValueError as e:  # repeated axes that are not one run
            raise Refused(str(e)) from None
    return a, b


@converter("Add", "Sub")
def add_sub(imp, node, inputs, attrs):
    a, b = _operands(imp, inputs)
    if isinstance(a, Value) and isinstance(b, Value):
        if node.op_type == "Sub":
            b = imp.net.add(L.Scale(-1.0), [b])
        return [imp.add(L.Add(), [a, b], node)]
    tensor = node.input[0]  # the ONNX name of the value operand
    if not isinstance(a, Value):
        if node.op_type == "Sub":
            raise Refused("a constant minus an input")
        a, b, tensor = b, a, node.input[1]
    bias = None if isinstance(b, shapes.PerPosition) else bias_of(b, a.spec.shape, node.op_type == "Sub")
    if bias is None and _per_position(imp, a, b) is not None:
        layer = L.PositionalEmbedding(*_per_position(imp, a, b).shape)
        assign(layer, "weight", -_per_position(imp, a, b) if node.op_type == "Sub" else _per_position(imp, a, b))
        return [imp.add(layer, [a], node)]
    if bias is None:
        over_time = isinstance(b, shapes.PerPosition)
        shape = b.values.shape if over_time else b.shape
        raise Refused(f"a constant of shape {list(shape)}{' (over the time steps)' if over_time else ''} that does "
                      f"not broadcast over one sample {list(a.spec.shape)}")
    layer = imp.linear_of.get(tensor)
    if layer is not None and not layer.has_bias and imp.uses.get(tensor) == 1 and bias.ndim == 1:
        # MatMul + Add is Linear with a bias: fold it in
        layer.has_bias = True
        layer.add_param("bias", np.array(bias, np.float32))  # (a copy: bias may be a read-only view)
        layer.bind_parameters()
        imp.net._invalidate()
        return [a]
    bias_layer = L.Bias(a.spec.shape)
    assign(bias_layer, "bias", bias)
    return [imp.add(bias_layer, [a], node)]


def _per_channel(a, c):
    """c's values, one per channel, where the constant c broadcast over a's samples [C, spatial...]
    varies along the channels only; else None."""
    shape = a.spec.shape
    if a.spec.sequence or len(shape) < 2 or getattr(a, "onnx_axes", None) not in (None, default_axes(a.spec)):
        return None
    full = bias_of(c, shape, False)
    if full is None:
        return None
    per = full.reshape(shape[0], -1)
    return np.array(per[:, 0], np.float64) if np.all(per == per[:, :1]) else None


def _per_position(imp, a, c):
    """A constant added to each sequence by position, as [T, E] (from [T, E], [1, T, E], or [N, T, E]
    alike for every sample: position and token-type embeddings folded at a fixed length T, or a
    PerPosition of those up to the length of the model's buffer), or
    None where c is not that for the sequence batch a of [E] rows."""
    if not a.spec.sequence or len(a.spec.shape) != 1 or imp.axes_of(a) != ("N", "T", 0):
        return None
    if isinstance(c, shapes.PerPosition):  # over the time steps up to the buffer's length
        if c.axis != c.values.ndim - 2 or c.batch not in (None, c.axis - 1):
            return None
        c = c.values
    if c.ndim == 3 and np.all(c == c[:1]):
        c = c[0]
    return c if c.ndim == 2 and c.shape[1] == a.spec.shape[0] else None


@converter("Mul", "Div")
def mul_div(imp, node, inputs, attrs):
    if any(isinstance(v, (shapes.MaskOnes, shapes.Lengths)) for v in inputs):
        return [_masked(imp, node, inputs)]
    if node.op_type == "Div" and isinstance(inputs[1], Value):  # a / b = a · (1 / b)
        inputs = [inputs[0], imp.net.add(L.Activation("reciprocal"), [value(inputs[1], "input 1")])]
        if not isinstance(inputs[0], Value):  # a constant over a value: its reciprocal scaled
            return _scaled(imp, node, inputs[1], inputs[0], "Mul")
    a, b = _operands(imp, inputs)
    if isinstance(a, Value) and isinstance(b, Value):
        return [imp.add(L.Multiply(), [a, b], node)]
    if not isinstance(a, Value):
        a, b = b, a
    return _scaled(imp, node, a, b, node.op_type)


def _masked(imp, node, inputs):
    """A sequence times an attention mask (ones: nothing is padding) is the sequence; a sum over
    time divided by the lengths (a masked mean pooling, sentence-transformers') is the average."""
    a, b = inputs
    if node.op_type == "Mul" and isinstance(a, shapes.MaskOnes):
        a, b = b, a
    if node.op_type == "Mul" and isinstance(b, shapes.MaskOnes) and isinstance(a, Value) and a.spec.sequence and \
            imp.axes_of(a)[:2] == ("N", "T") and b.extra <= len(a.spec.shape):
        return a
    producer = a.producer.layer if isinstance(a, Value) and a.producer is not None else None
    if node.op_type == "Div" and isinstance(b, shapes.Lengths) and \
            isinstance(producer, L.SequencePool) and producer.mode == "sum":
        y = imp.add(L.SequencePool("average"), [imp.net.values[a.producer.input_names[0]]], node)
        if getattr(a, "onnx_axes", None):
            y.onnx_axes = a.onnx_axes
        return y
    raise Refused(f"{node.op_type} with an attention mask (lamina takes the product of a batch-first sequence and "
                  f"its mask, and a sum over time divided by the mask's sum)")


def _scaled(imp, node, a, b, op):
    """A value times (or over) a constant scalar, or a factor per channel of a sample [C,
    spatial...] (GroupNorm's weight in PyTorch's decomposition: a depthwise convolution)."""
    if not isinstance(b, np.ndarray):
        raise Refused(f"{op} of a value by a {type(b).__name__} (lamina takes a constant factor)")
    if b.size != 1:
        factors = _per_channel(a, b)
        if factors is None:
            raise Refused(f"a constant of shape {list(b.shape)}: a single factor (a scalar) or one per channel of "
                          f"{onnx_shape_text(imp, a)}")
        if op == "Div" and not np.all(factors):
            raise Refused("division by a constant with zeros")
        from .normalization import channel_affine
        return [channel_affine(imp, node, a, 1.0 / factors if op == "Div" else factors, None)]
    factor = float(b.reshape(()))
    if op == "Div":
        if factor == 0:
            raise Refused("division by a constant zero")
        factor = 1.0 / factor
    return [imp.add(L.Scale(factor), [a], node)]


@converter("Expand")
def expand(imp, node, inputs, attrs):
    """A value repeated along its axes of size 1 (lamina's Broadcast); the batch (and time) axes
    stay as they are."""
    x = value(inputs[0], "input")
    target = inputs[1]
    if not isinstance(target, (np.ndarray, shapes.Symbolic)):
        raise Refused("the shape must be a constant or computed from shapes")
    target = list(target.values) if isinstance(target, shapes.Symbolic) else [int(t) for t in target]
    lead = 2 if x.spec.sequence else 1
    if len(target) != lead + len(x.spec.shape) or any(t not in (1, "N", "T") for t in target[:lead]):
        raise Refused(f"shape {target} for a value of shape {onnx_shape_text(imp, x)} (lamina expands a sample's "
                      f"axes, same rank, the batch axes as they are)")
    rest = target[lead:]
    if any(isinstance(t, str) for t in rest):
        raise Refused(f"shape {target}: the batch or time size inside a sample")
    try:
        sample = np.broadcast_shapes(x.spec.shape, tuple(rest))
        return [x if sample == x.spec.shape else imp.add(L.Broadcast(sample), [x], node)]
    except ValueError as e:
        raise Refused(str(e)) from None


@converter("Pow")
def power(imp, node, inputs, attrs):
    """x to a small whole constant power, as products (x³ in PyTorch's decomposition of the tanh
    GELU)."""
    x = value(inputs[0], "X")
    exponent = const(inputs[1], "Y (the exponent)")
    if exponent.size != 1:
        raise Refused(f"an exponent of shape {list(exponent.shape)} (lamina takes one, a whole power 1 to 4)")
    if float(exponent.reshape(())) not in (1.0, 2.0, 3.0, 4.0):
        raise Refused(f"exponent {exponent.reshape(()).item()} (lamina takes the whole powers 1 to 4, as products)")
    y = x
    for _ in range(int(exponent.reshape(())) - 1):
        y = imp.net.add(L.Multiply(), [y, x])
    return [y if y is not x else imp.add(L.Scale(1.0), [x], node)]
