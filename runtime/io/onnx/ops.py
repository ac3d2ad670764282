"""ONNX operators as lamina layers: one converter per operator, `convert(imp, node, inputs,
attrs) -> outputs`. Inputs arrive as numpy constants or lamina Values (batch axis implied);
a converter raises Refused, saying which attribute or case lamina lacks, for anything it
cannot map exactly."""
import math

import numpy as np

from ... import layers as L
from ...graph import Value
from . import shapes
from .importer import Refused, default_axes

CONVERTERS: dict = {}
ATTRIBUTES: dict[str, tuple] = {}  # operator -> the attributes its converter reads (any other is refused)
# operators converted even when every input is a constant (none yet: every listed one folds)
NEVER_FOLD: frozenset[str] = frozenset()


def converter(*op_types, attributes=()):
    def register(fn):
        for op in op_types:
            CONVERTERS[op] = fn
            ATTRIBUTES[op] = frozenset(attributes)
        return fn
    return register


def unsupported_attributes(op_type, attrs):
    """The attributes of a node that lamina's converter does not read, as a refusal reason."""
    extra = sorted(set(attrs) - ATTRIBUTES.get(op_type, frozenset()))
    return f"attribute{'s' if len(extra) > 1 else ''} {', '.join(extra)} not supported" if extra else None


def value(x, what, kind="float", imp=None):
    """An input that is a lamina value of `kind` ('float': lamina's layers compute on floats),
    in the usual layout (batch, and time, first) unless the converter handles others itself."""
    if not isinstance(x, Value):
        raise Refused(f"{what} must depend on the model's inputs (a constant here)")
    if x.spec.kind != kind:
        raise Refused(f"{what} holds {x.spec.kind} values; this operator computes on {kind} in lamina")
    axes = getattr(x, "onnx_axes", None)
    if axes is not None and axes != default_axes(x.spec):
        raise Refused(f"{what} has its axes as {axes} (N batch, T time, k lamina's axis k); this operator "
                      f"takes the batch axis first")
    return x


def onnx_shape_text(imp, x):
    """A value's ONNX shape for a message: [N, 3, 4], the batch and time axes by name."""
    return f"[{', '.join(map(str, shapes.onnx_shape(imp, x)))}]" + (" (a sequence)" if x.spec.sequence else "")


def const(x, what):
    if not isinstance(x, np.ndarray):
        raise Refused(f"{what} must be a constant (an initializer); lamina takes it as a parameter")
    if x.dtype.kind not in "biuf":
        raise Refused(f"{what} is a tensor of {x.dtype} (strings?); lamina takes numbers")
    return x


def text(attrs, name, default):
    """A string attribute (the onnx package gives them as bytes)."""
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v


def assign(layer, name, values):
    p = layer.params[name]
    values = np.asarray(values)
    if values.dtype.kind not in "biuf":
        raise Refused(f"{name} is a tensor of {values.dtype} (strings?); lamina's parameters are numbers")
    values = values.astype(np.float32)
    if values.shape != p.shape:
        raise Refused(f"{name} has shape {values.shape}, the layer expects {p.shape}")
    if not np.all(np.isfinite(values)):
        raise Refused(f"{name} holds NaN or infinity (as float32: {np.count_nonzero(~np.isfinite(values))} of "
                      f"{values.size} values)")
    p.assign(values)


# ---------------------------------------------------------------------------- pass-through

@converter("Identity")
def identity(imp, node, inputs, attrs):
    return [inputs[0]]


@converter("Dropout", attributes={"seed"})
def dropout(imp, node, inputs, attrs):
    # inference semantics: the output is the input; a mask output has no lamina counterpart
    if len(node.output) > 1 and node.output[1] and imp.uses.get(node.output[1]):
        raise Refused("the mask output is used")
    if len(inputs) > 2 and inputs[2] is not None and (not isinstance(inputs[2], np.ndarray) or bool(inputs[2])):
        raise Refused("training_mode true (random masks at inference)")
    return [inputs[0], None]


@converter("Cast", attributes={"to", "saturate", "round_mode"})
def cast(imp, node, inputs, attrs):
    """A cast that keeps lamina's kind of value (integers to integers, floats to floats) is the
    identity here: lamina holds ids as int32 and floats in the network's type."""
    x = inputs[0]
    tp = imp.onnx.TensorProto
    ints = {tp.INT8, tp.INT16, tp.INT32, tp.INT64, tp.UINT8, tp.UINT16, tp.UINT32}
    floats = {tp.FLOAT, tp.DOUBLE, tp.FLOAT16}
    to = attrs["to"]
    if (x.spec.kind == "int32" and to in ints) or (x.spec.kind == "float" and to in floats):
        return [x]
    raise Refused(f"a cast of {x.spec.kind} values to {tp.DataType.Name(to)} (lamina keeps ids and floats apart)")


# ---------------------------------------------------------------------------- activations

def _activation(kind, slope=0.01):
    """An element-wise activation; `slope` is the default of the ONNX attribute 'alpha'."""
    def convert(imp, node, inputs, attrs):
        x = value(inputs[0], "input")
        return [imp.add(L.Activation(kind, slope=attrs.get("alpha", slope)), [x], node)]
    return convert


for _op, _kind in (("Relu", "relu"), ("Sigmoid", "sigmoid"), ("Tanh", "tanh"), ("Softplus", "softrelu"),
                  ("Exp", "exponential"), ("Softsign", "softsign"), ("HardSwish", "hard_swish"), ("Sqrt", "sqrt"),
                  ("Reciprocal", "reciprocal"), ("Log", "log"), ("Abs", "abs"), ("Erf", "erf")):
    converter(_op)(_activation(_kind))


@converter("Neg")
def neg(imp, node, inputs, attrs):
    return [imp.add(L.Scale(-1.0), [value(inputs[0], "X")], node)]
converter("LeakyRelu", attributes={"alpha"})(_activation("leaky_relu", 0.01))
converter("Elu", attributes={"alpha"})(_activation("elu", 1.0))


@converter("Clip", attributes={"min", "max"})
def clip(imp, node, inputs, attrs):
    """min(max(x, lo), hi): with lo 0 a bounded ReLU (ReLU6) or a ReLU; another lower bound shifts
    the value to 0 and back, an upper bound alone clips -x from below (fixed shifts and signs, not
    trained). The bounds are constants (opset 11's inputs, or the attributes before it)."""
    x = value(inputs[0], "input")
    lo, hi = (_bound(inputs[k] if len(inputs) > k else None, attrs.get(name), name, default)
              for k, name, default in ((1, "min", -math.inf), (2, "max", math.inf)))
    if not lo <= hi or math.isnan(lo) or math.isnan(hi):
        raise Refused(f"bounds min {lo} > max {hi} (every output would be max)")
    if lo == hi:
        raise Refused(f"bounds min = max = {lo} (every output would be that constant)")
    if math.isinf(lo) and math.isinf(hi):
        return [imp.add(L.Scale(1.0), [x], node)]
    if math.isinf(lo):  # min(x, hi) = -max(-x, -hi)
        y = _clip_from_below(imp, imp.net.add(L.Scale(-1.0), [x]), -hi, math.inf, None)
        return [imp.add(L.Scale(-1.0), [y], node)]
    return [_clip_from_below(imp, x, lo, hi, node)]


def _clip_from_below(imp, x, lo, hi, node):
    """min(max(x, lo), hi) for a finite lo: a (bounded) ReLU of x - lo, plus lo; the last layer
    named after `node` (None: an inner part)."""
    def last(layer, y):
        return imp.add(layer, [y], node) if node is not None else imp.net.add(layer, [y])
    act = L.Activation("relu") if math.isinf(hi) else L.Activation("bounded_relu", slope=hi - lo)
    if lo == 0:
        return last(act, x)
    y = imp.net.add(act, [_shift(imp, x, -lo)])
    return last(_shift_layer(y.spec.shape, lo), y)


def _bound(given, attribute, name, default):
    """One of Clip's bounds as a float: its input, its attribute (opset < 11) or the default."""
    if given is None:
        return float(attribute) if attribute is not None else default
    bound = const(given, name)
    if bound.size != 1:
        raise Refused(f"{name} must be a scalar, found shape {list(bound.shape)}")
    return float(bound.reshape(()))


def _shift_layer(shape, amount):
    """A Bias layer adding `amount` everywhere, frozen (a fixed part of an operator)."""
    layer = L.Bias(shape)
    bias = layer.params["bias"]
    bias.assign(np.full(bias.shape, amount, np.float32))
    bias.frozen = True
    return layer


def _shift(imp, x, amount):
    return imp.net.add(_shift_layer(x.spec.shape, amount), [x])


@converter("HardSigmoid", attributes={"alpha", "beta"})
def hard_sigmoid(imp, node, inputs, attrs):
    if abs(attrs.get("beta", 0.5) - 0.5) > 1e-7:
        raise Refused(f"beta {attrs['beta']} (lamina's hard sigmoid has beta 0.5, as PyTorch's)")
    return _activation("hard_sigmoid", 0.2)(imp, node, inputs, attrs)


@converter("Selu", attributes={"alpha", "gamma"})
def selu(imp, node, inputs, attrs):
    if abs(attrs.get("alpha", 1.6732632423543772) - 1.6732632423543772) > 1e-6 or \
            abs(attrs.get("gamma", 1.0507009873554805) - 1.0507009873554805) > 1e-6:
        raise Refused(f"alpha {attrs.get('alpha')} and gamma {attrs.get('gamma')} (lamina's SELU has the standard "
                      f"constants)")
    return _activation("selu")(imp, node, inputs, {})


@converter("Gelu", attributes={"approximate"})
def gelu(imp, node, inputs, attrs):
    approximate = text(attrs, "approximate", "none")
    if approximate not in ("none", "tanh"):
        raise Refused(f"approximate={approximate!r} (ONNX defines 'none' and 'tanh')")
    return _activation("gelu" if approximate == "none" else "gelu_tanh")(imp, node, inputs, {})


@converter("PRelu")
def prelu(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    slope = const(inputs[1], "slope")
    full = _bias_of(slope, x.spec.shape, negate=False)  # slope over one sample's shape
    if full is None:
        raise Refused(f"a slope of shape {list(slope.shape)} that does not broadcast over one sample "
                      f"{list(x.spec.shape)}")
    per_channel = full.reshape(full.shape[0], -1)[:, 0]
    if np.all(full == full.flat[0]):
        layer, slopes = L.PReLU(1), full.reshape(-1)[:1]
    elif np.array_equal(full, np.broadcast_to(per_channel.reshape((-1,) + (1,) * (full.ndim - 1)), full.shape)):
        layer, slopes = L.PReLU(len(per_channel)), per_channel
    else:
        raise Refused(f"a slope of shape {list(slope.shape)} that varies along more than the channel axis "
                      f"(lamina's PReLU has one slope per channel, as PyTorch's)")
    assign(layer, "weight", slopes)
    return [imp.add(layer, [x], node)]


@converter("Softmax", "LogSoftmax", attributes={"axis"})
def softmax(imp, node, inputs, attrs):
    """Along any axis of a sample: lamina's softmax runs along the last, so another axis is moved
    there and back (two Transpose layers)."""
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("input must be float values computed from the model's inputs")
    axis = attrs.get("axis", -1 if imp.opset >= 13 else 1)
    k = shapes.along(imp, x, axis, "axis")
    last = len(x.spec.shape) - 1
    if imp.opset < 13 and k != last:  # opset < 13 flattens from `axis` on: a softmax along one axis only at the end
        raise Refused(f"axis {axis} before the last at opset {imp.opset} (a softmax over the flattened trailing axes)")
    kind = "softmax" if node.op_type == "Softmax" else "log_softmax"
    if k == last:
        y = imp.add(L.Activation(kind), [x], node)
    else:
        to_end = [i for i in range(last + 1) if i != k] + [k]
        y = imp.net.add(L.Activation(kind), [shapes.moved(imp, x, to_end)])
        y = imp.add(L.Transpose([to_end.index(i) for i in range(last + 1)]), [y], node)
    if getattr(x, "onnx_axes", None):
        y.onnx_axes = x.onnx_axes
    return [y]


# ---------------------------------------------------------------------------- dense

@converter("Gemm", attributes={"alpha", "beta", "transA", "transB"})
def gemm(imp, node, inputs, attrs):
    a = value(inputs[0], "A")
    b = const(inputs[1], "B")
    if attrs.get("transA", 0):
        raise Refused("transA=1 with A from the inputs (it would move the batch axis)")
    if len(a.spec.shape) != 1 or b.ndim != 2:
        raise Refused(f"A must be [batch, K] and B 2-D, found A {onnx_shape_text(imp, a)}, B {list(b.shape)}")
    bm = b.T if attrs.get("transB", 0) else b  # [K, M]
    k, m = bm.shape
    if k != a.spec.shape[0]:
        raise Refused(f"A has {a.spec.shape[0]} columns, B {k} rows")
    c = inputs[2] if len(inputs) > 2 else None
    bias = None
    if c is not None:
        c = const(c, "C")
        try:
            bias = np.broadcast_to(c, (1, m)).reshape(m) * attrs.get("beta", 1.0)
        except ValueError:
            raise Refused(f"C of shape {list(c.shape)} is not a bias over the {m} outputs") from None
    layer = L.Linear(k, m, bias=bias is not None)
    assign(layer, "weight", attrs.get("alpha", 1.0) * bm.T)
    if bias is not None:
        assign(layer, "bias", bias)
    return [imp.add(layer, [a], node)]


@converter("MatMul")
def matmul(imp, node, inputs, attrs):
    a = value(inputs[0], "A")
    b = const(inputs[1], "B (the second operand)")
    if len(a.spec.shape) != 1 or b.ndim != 2 or b.shape[0] != a.spec.shape[0]:
        raise Refused(f"A [batch, K] times a constant B [K, M] only; found A {onnx_shape_text(imp, a)}, B {list(b.shape)}")
    layer = L.Linear(b.shape[0], b.shape[1], bias=False)
    assign(layer, "weight", b.T)
    out = imp.add(layer, [a], node)
    imp.linear_of[node.output[0]] = layer
    return [out]


def _bias_of(c, shape, negate):
    """A constant broadcast over one sample's shape, or None where it varies along the batch."""
    if c.ndim > len(shape) + 1 or (c.ndim == len(shape) + 1 and c.shape[0] != 1):
        return None
    try:
        full = np.broadcast_to(c.reshape(c.shape[1:] if c.ndim == len(shape) + 1 else c.shape), shape)
    except ValueError:
        return None
    return -full if negate else full


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
    bias = _bias_of(b, a.spec.shape, node.op_type == "Sub")
    if bias is None:
        raise Refused(f"a constant of shape {list(b.shape)} that does not broadcast over one sample "
                      f"{list(a.spec.shape)}")
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


@converter("Mul", "Div")
def mul_div(imp, node, inputs, attrs):
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


def _scaled(imp, node, a, b, op):
    """A value times (or over) a constant scalar."""
    if b.size != 1:
        raise Refused(f"a constant of shape {list(b.shape)}: only a single factor (a scalar) is supported")
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


# ---------------------------------------------------------------------------- volumes

def _spatial(imp, x, what):
    nd = len(x.spec.shape) - 1
    if nd not in (2, 3) or x.spec.sequence:
        raise Refused(f"{what} must be [N, C, L], [N, C, H, W] or [N, C, D, H, W], found {onnx_shape_text(imp, x)}")
    return nd


@converter("Resize", attributes={"mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a",
                                 "exclude_outside", "extrapolation_value", "antialias", "axes",
                                 "keep_aspect_ratio_policy"})
def resize(imp, node, inputs, attrs):
    """lamina's Resize over the spatial axes of [N, C, *spatial]: nearest or (bi/tri)linear, from
    scales or sizes (constants, or sizes computed with the batch size)."""
    x = value(inputs[0], "X")
    if x.spec.sequence or not 2 <= len(x.spec.shape) <= 4:
        raise Refused(f"X must be [N, C, *spatial] with 1 to 3 spatial axes, found {onnx_shape_text(imp, x)}")
    if imp.opset < 11:  # Resize-10: (X, scales)
        scales, sizes = inputs[1], None
    else:
        scales, sizes = (inputs[k] if len(inputs) > k else None for k in (2, 3))
    for name, default in (("antialias", 0), ("exclude_outside", 0), ("keep_aspect_ratio_policy", "stretch")):
        if text(attrs, name, default) != default:
            raise Refused(f"{name}={text(attrs, name, default)!r}")
    if attrs.get("axes") is not None:  # scales or sizes for these axes only: the others keep theirs
        rank = len(x.spec.shape) + 1
        axes = [a + rank if a < 0 else a for a in attrs["axes"]]
        if sorted(set(axes)) != sorted(axes) or not all(2 <= a < rank for a in axes):
            raise Refused(f"axes {attrs['axes']} (lamina resizes the spatial axes of a rank-{rank} X)")
        if scales is not None and np.size(scales):
            full = np.ones(rank, np.float32)
            full[axes] = const(scales, "scales").reshape(-1)
            scales = full
        if sizes is not None and np.size(shapes._symbolic(sizes)):
            full = ["N"] + list(x.spec.shape)
            for a, n in zip(axes, shapes._symbolic(sizes).reshape(-1)):
                full[a] = n
            sizes = shapes.Symbolic(full)
    coordinates = text(attrs, "coordinate_transformation_mode", "half_pixel" if imp.opset >= 11 else "asymmetric")
    return [_resized(imp, node, x, text(attrs, "mode", "nearest"), coordinates,
                     text(attrs, "nearest_mode", "round_prefer_floor"), scales, sizes)]


@converter("Upsample", attributes={"mode", "scales"})
def upsample(imp, node, inputs, attrs):
    """ONNX's Upsample (before Resize): scales from the attribute (opset 7) or the input (9),
    asymmetric coordinates, nearest neighbours rounded down as ONNX defines it."""
    x = value(inputs[0], "X")
    scales = inputs[1] if len(inputs) > 1 else np.asarray(attrs.get("scales", []), np.float32)
    return [_resized(imp, node, x, text(attrs, "mode", "nearest"), "asymmetric", "floor", scales, None)]


def _resized(imp, node, x, mode, coordinates, rounding, scales, sizes):
    from ...layers.resize import COORDINATES, ROUNDINGS
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(mode, mode)
    if mode not in ("nearest", "linear"):
        raise Refused(f"mode {mode!r} (lamina resizes by nearest neighbours or linearly)")
    if coordinates not in COORDINATES:
        raise Refused(f"coordinate_transformation_mode {coordinates!r}")
    if rounding not in ROUNDINGS:
        raise Refused(f"nearest_mode {rounding!r}")
    if imp.axes_of(x) != default_axes(x.spec):
        raise Refused(f"X has its axes as {imp.axes_of(x)} (lamina resizes [N, C, *spatial])")
    spatial = x.spec.shape[1:]
    given_scales = None
    if isinstance(sizes, (np.ndarray, shapes.Symbolic)) and np.size(shapes._symbolic(sizes)):
        full = list(shapes._symbolic(sizes))
        if len(full) != len(spatial) + 2 or any(isinstance(s, str) for s in full[1:]) or full[1] != x.spec.shape[0]:
            raise Refused(f"sizes {full} for X {onnx_shape_text(imp, x)} (lamina resizes the spatial axes)")
        size = [int(s) for s in full[2:]]
    else:
        scales = const(scales, "scales") if scales is not None else None
        if scales is None or scales.size != len(spatial) + 2:
            raise Refused(f"scales {None if scales is None else scales.tolist()} for X {onnx_shape_text(imp, x)}")
        if scales[0] != 1 or scales[1] != 1:
            raise Refused(f"scales {scales.tolist()} resize the batch or channel axis")
        given_scales = [float(s) for s in scales[2:]]
        size = [int(math.floor(n * s)) for n, s in zip(spatial, given_scales)]
    if min(size) < 1:
        raise Refused(f"an output of spatial size {size}")
    return imp.add(L.Resize(size, mode=mode, coordinates=coordinates, rounding=rounding, scales=given_scales),
                   [x], node)


UNIT = {"kernel_shape": 1, "strides": 1, "dilations": 1, "output_padding": 0}


def lifted_to_2d(convert):
    """A converter of 2-D and 3-D volumes that also takes [N, C, L] (and, for batch norm,
    [N, C]) as [N, C, 1, L]: a unit height is added to the input, the attributes and the weights,
    and dropped from the output."""
    def lifted(imp, node, inputs, attrs):
        x = inputs[0]
        if not (isinstance(x, Value) and len(x.spec.shape) in (1, 2) and not x.spec.sequence
                and x.spec.kind == "float" and imp.axes_of(x) == default_axes(x.spec)):
            return convert(imp, node, inputs, attrs)
        c, length = (x.spec.shape + (1,))[:2]
        attrs = {k: ([UNIT[k]] + list(v) if k in UNIT else v) for k, v in attrs.items()}
        if "pads" in attrs:
            attrs["pads"] = [0, attrs["pads"][0], 0, attrs["pads"][1]]
        if "output_shape" in attrs:
            attrs["output_shape"] = [1, attrs["output_shape"][-1]]
        inputs = list(inputs)
        inputs[0] = imp.net.add(L.Reshape((c, 1, length)), [x])
        if node.op_type in ("Conv", "ConvTranspose") and isinstance(inputs[1], np.ndarray):
            inputs[1] = inputs[1][:, :, None]  # W [M, C/group, k] -> [M, C/group, 1, k]
        outs = list(convert(imp, node, inputs, attrs))
        y = outs[0]
        outs[0] = imp.net.add(L.Reshape(y.spec.shape[:1] + y.spec.shape[2:] if len(x.spec.shape) == 2
                                        else y.spec.shape[:1]), [y])
        return outs
    return lifted


def _pads(attrs, nd, spatial, kernel, stride, dilation, asymmetric=False):
    """Per-axis padding from pads / auto_pad: (before, after) pairs where `asymmetric` is
    allowed, else one padding per axis (or Refused where the sides differ)."""
    auto = text(attrs, "auto_pad", "NOTSET")
    if auto in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for n, k, s, d in zip(spatial, kernel, stride, dilation):
            out = -(-n // s)
            total = max(0, (out - 1) * s + (k - 1) * d + 1 - n)
            lo = total // 2 if auto == "SAME_UPPER" else total - total // 2
            pads.append((lo, total - lo))
    elif auto == "VALID":
        pads = [(0, 0)] * nd
    else:
        flat = list(attrs.get("pads", [0] * 2 * nd))
        pads = list(zip(flat[:nd], flat[nd:]))
    if asymmetric:
        return tuple(pads)
    if any(lo != hi for lo, hi in pads):
        raise Refused(f"asymmetric padding {pads} (auto_pad {auto}); lamina's pools pad both sides alike")
    return tuple(lo for lo, _ in pads)


def _conv_operands(imp, inputs, attrs):
    """What Conv and ConvTranspose share: X, W, B (or None), the spatial rank, kernel, strides,
    dilations and groups."""
    x = value(inputs[0], "X")
    w = const(inputs[1], "W")
    b = const(inputs[2], "B") if len(inputs) > 2 and inputs[2] is not None else None
    nd = _spatial(imp, x, "X")
    kernel = tuple(w.shape[2:])
    if tuple(attrs.get("kernel_shape", kernel)) != kernel:
        raise Refused(f"kernel_shape {attrs['kernel_shape']} differs from W's {list(kernel)}")
    return (x, w, b, nd, kernel, tuple(attrs.get("strides", [1] * nd)), tuple(attrs.get("dilations", [1] * nd)),
            attrs.get("group", 1))


def _with_weights(imp, node, layer, x, w, b):
    assign(layer, "weight", w)
    if b is not None:
        assign(layer, "bias", b)
    return [imp.add(layer, [x], node)]


@converter("Conv", attributes={"auto_pad", "dilations", "group", "kernel_shape", "pads", "strides"})
@lifted_to_2d
def conv(imp, node, inputs, attrs):
    x, w, b, nd, kernel, stride, dilation, groups = _conv_operands(imp, inputs, attrs)
    padding = _pads(attrs, nd, x.spec.shape[1:], kernel, stride, dilation, asymmetric=True)
    in_channels = x.spec.shape[0]
    if w.shape[1] * groups != in_channels:
        raise Refused(f"W has {w.shape[1]} input channels per group, X has {in_channels} for group {groups}")
    layer = (L.Conv2d if nd == 2 else L.Conv3d)(in_channels, w.shape[0], kernel, stride=stride, padding=padding,
                                               dilation=dilation, groups=groups, bias=b is not None)
    return _with_weights(imp, node, layer, x, w, b)


@converter("ConvTranspose", attributes={"auto_pad", "dilations", "group", "kernel_shape",
                                          "output_padding", "output_shape", "pads", "strides"})
@lifted_to_2d
def conv_transpose(imp, node, inputs, attrs):
    x, w, b, nd, kernel, stride, dilation, groups = _conv_operands(imp, inputs, attrs)
    spatial = x.spec.shape[1:]
    output_padding = list(attrs.get("output_padding", [0] * nd))
    auto = text(attrs, "auto_pad", "NOTSET")
    if "output_shape" in attrs or auto in ("SAME_UPPER", "SAME_LOWER"):
        # the padding that gives the requested size (SAME: input size times stride), split as
        # ONNX's ConvTranspose says: the larger half at the end for SAME_UPPER, else at the start
        wanted = list(attrs["output_shape"])[-nd:] if "output_shape" in attrs else [n * s for n, s in
                                                                                       zip(spatial, stride)]
        padding = []
        for i, (n, k, s, d) in enumerate(zip(spatial, kernel, stride, dilation)):
            total = s * (n - 1) + output_padding[i] + (k - 1) * d + 1 - wanted[i]
            small = total // 2
            before, after = (small, total - small) if auto == "SAME_UPPER" else (total - small, small)
            if after < 0:  # a larger output than the kernel reaches: zeros (and the bias) at the end
                output_padding[i], after = output_padding[i] - after, 0
            if before < 0:
                raise Refused(f"output_shape {wanted} needs the output to start before the first input")
            padding.append((before, after))
    else:
        flat = list(attrs.get("pads", [0] * 2 * nd))
        padding = list(zip(flat[:nd], flat[nd:]))
    in_channels = x.spec.shape[0]
    if w.shape[0] != in_channels:
        raise Refused(f"W has {w.shape[0]} input channels, X has {in_channels}")
    try:
        layer = (L.ConvTranspose2d if nd == 2 else L.ConvTranspose3d)(
            in_channels, w.shape[1] * groups, kernel, stride=stride, padding=tuple(padding), dilation=dilation,
            groups=groups, bias=b is not None, output_padding=tuple(output_padding))
    except ValueError as e:  # (an output_padding of stride or more: lamina follows PyTorch's limit)
        raise Refused(str(e)) from None
    return _with_weights(imp, node, layer, x, w, b)


def _pool_window(imp, node, x, attrs, nd):
    """kernel, stride, (before, after) padding pairs and ceil_mode of a pool node."""
    kernel = tuple(attrs["kernel_shape"])
    stride = tuple(attrs.get("strides", [1] * nd))
    if any(d != 1 for d in attrs.get("dilations", [1] * nd)):
        raise Refused(f"dilations {attrs['dilations']} (lamina's pools have none)")
    padding = _pads(attrs, nd, x.spec.shape[1:], kernel, stride, (1,) * nd, asymmetric=True)
    if any(2 * p > k for pair, k in zip(padding, kernel) for p in pair):
        raise Refused(f"padding {[list(p) for p in padding]} more than half the kernel {list(kernel)}")
    return kernel, stride, padding, bool(attrs.get("ceil_mode", 0))


def _pool(imp, node, x, layer_type, *args, **kw):
    try:
        layer = layer_type(*args, **kw)
        return imp.add(layer, [x], node)
    except ValueError as e:  # (a combination lamina's pools refuse, said by the layer)
        raise Refused(str(e)) from None


@converter("MaxPool", attributes={"auto_pad", "ceil_mode", "dilations", "kernel_shape", "pads",
                                    "storage_order", "strides"})
@lifted_to_2d
def max_pool(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    if len(node.output) > 1 and node.output[1]:
        raise Refused("the Indices output")
    kernel, stride, padding, ceil_mode = _pool_window(imp, node, x, attrs, nd)
    return [_pool(imp, node, x, L.MaxPool2d if nd == 2 else L.MaxPool3d, kernel, stride, padding, ceil_mode)]


@converter("AveragePool", attributes={"auto_pad", "ceil_mode", "count_include_pad", "dilations",
                                        "kernel_shape", "pads", "strides"})
@lifted_to_2d
def average_pool(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    kernel, stride, padding, ceil_mode = _pool_window(imp, node, x, attrs, nd)
    return [_pool(imp, node, x, L.AvgPool2d if nd == 2 else L.AvgPool3d, kernel, stride, padding,
                  count_include_pad=bool(attrs.get("count_include_pad", 0)), ceil_mode=ceil_mode)]


@converter("GlobalAveragePool")
@lifted_to_2d
def global_average_pool(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    spatial = x.spec.shape[1:]
    layer = (L.AvgPool2d if nd == 2 else L.AvgPool3d)(spatial, spatial, 0)
    return [imp.add(layer, [x], node)]


@converter("ReduceMean", attributes={"axes", "keepdims", "noop_with_empty_axes"})
@lifted_to_2d
def reduce_mean(imp, node, inputs, attrs):
    """The mean over every spatial axis of [N, C, *spatial] (what PyTorch's exporter writes for
    AdaptiveAvgPool(1) and x.mean((2, 3))): a global average pool."""
    x = value(inputs[0], "data")
    nd = _spatial(imp, x, "data")
    axes = shapes.constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
    rank = len(x.spec.shape) + 1
    if axes is None or sorted(a + rank if a < 0 else a for a in axes) != list(range(2, rank)):
        raise Refused(f"axes {axes} (lamina averages over every spatial axis of [N, C, *spatial])")
    spatial = x.spec.shape[1:]
    y = imp.add((L.AvgPool2d if nd == 2 else L.AvgPool3d)(spatial, spatial, 0), [x], node)
    if not attrs.get("keepdims", 1):
        y = imp.net.add(L.Reshape((x.spec.shape[0],)), [y])
    return [y]


@converter("BatchNormalization", attributes={"epsilon", "momentum", "training_mode", "spatial"})
@lifted_to_2d
def batch_norm(imp, node, inputs, attrs):
    if attrs.get("training_mode", 0):
        raise Refused("training_mode=1 (the imported layer uses the running statistics)")
    if len(node.output) > 1 and any(node.output[1:]):
        raise Refused("the running-statistics outputs (training mode)")
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    scale, bias, mean, var = (const(v, n) for v, n in zip(inputs[1:5], ("scale", "B", "input_mean", "input_var")))
    channels = x.spec.shape[0]
    layer = (L.BatchNorm2d if nd == 2 else L.BatchNorm3d)(channels, eps=attrs.get("epsilon", 1e-5),
                                                         momentum=1 - attrs.get("momentum", 0.9),
                                                         frozen_statistics=True)
    for name, values in (("weight", scale), ("bias", bias), ("running_mean", mean), ("running_var", var)):
        assign(layer, name, values)
    return [imp.add(layer, [x], node)]


# ---------------------------------------------------------------------------- scores

@converter("SoftmaxCrossEntropyLoss", attributes={"reduction", "ignore_index"})
def softmax_cross_entropy_loss(imp, node, inputs, attrs):
    """With reduction 'none': one negative log-likelihood per row (per step of a sequence), the
    classes on axis 1; lamina's SoftmaxCrossEntropy as a score (objective=False), since a model
    file's output is something inference computes. An ignore_index outside the class range
    (PyTorch's -100) is taken: lamina refuses such a label at run time, naming the row, where
    ONNX gives that row 0."""
    reduction = text(attrs, "reduction", "mean")
    if reduction != "none":
        raise Refused(f"reduction '{reduction}' (a loss over the batch); lamina imports the per-row values, "
                      f"reduction 'none'")
    if len(inputs) > 2 and inputs[2] is not None:
        raise Refused("class weights")
    if len(node.output) > 1 and node.output[1] and imp.uses.get(node.output[1]):
        raise Refused("the log_prob output is used")
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float" or len(x.spec.shape) != 1:
        raise Refused("the scores must be float values computed from the model's inputs, [N, classes] or a "
                      "sequence's [N, classes, T]")
    classes_second = ("N", 0, "T") if x.spec.sequence else ("N", 0)
    if imp.axes_of(x) != classes_second:
        raise Refused(f"the scores' axes are {imp.axes_of(x)}; the classes must be axis 1")
    ignore = attrs.get("ignore_index")
    if ignore is not None and 0 <= ignore < x.spec.shape[0]:
        raise Refused(f"ignore_index {ignore}, a class (rows of that class would score 0)")
    labels = value(inputs[1], "input 1 (the labels)", kind="int32")
    return [imp.add(L.SoftmaxCrossEntropy(objective=False), [x, labels], node)]


# ---------------------------------------------------------------------------- recurrent

# ONNX's gate blocks in lamina's (PyTorch's) order: LSTM i,o,f,c -> i,f,g,o; GRU z,r,h -> r,z,n
GATE_ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


def _zero_or_absent(x, what):
    if x is not None and not isinstance(x, shapes.Zeros) and (not isinstance(x, np.ndarray) or np.any(x)):
        raise Refused(f"{what} a constant other than zero (lamina's initial states are zero or inputs)")


def _initial_states(imp, given, directions, hidden, layout):
    """initial_h (and initial_c) as the lamina layer's state inputs: values whose ONNX tensor is
    [D, N, H] (layout 0) or [N, D, H] (layout 1), which is lamina's [N, D, H] either way; zeros
    (or absent) need no input. lamina's inputs go in order: h0, then c0."""
    want = (0, "N", 1) if layout == 0 else ("N", 0, 1)
    states = []
    for x, what in zip(given, ("initial_h", "initial_c")):
        if isinstance(x, Value):
            if x.spec.kind != "float" or x.spec.sequence or x.spec.shape != (directions, hidden) or \
                    imp.axes_of(x) != want:
                raise Refused(f"{what} must be a float tensor {['D' if a == 0 else 'H' if a == 1 else a for a in want]}"
                              f" = {[directions, hidden]} per sequence, found {onnx_shape_text(imp, x)}")
            states.append(x)
        else:
            _zero_or_absent(x, what)
            states.append(None)
    while states and states[-1] is None:
        states.pop()
    if None in states:
        raise Refused("initial_c from an input with a zero initial_h (lamina takes h0 before c0)")
    return states


def _reorder(blocks, op, hidden):
    """[G·H, ...] in ONNX's gate order → lamina's."""
    parts = [blocks[g * hidden:(g + 1) * hidden] for g in range(len(GATE_ORDER[op]))]
    return np.concatenate([parts[g] for g in GATE_ORDER[op]])


@converter("LSTM", "GRU", "RNN", attributes={"activation_alpha", "activation_beta", "activations", "clip",
                                             "direction", "hidden_size", "input_forget", "layout",
                                             "linear_before_reset"})
def recurrent(imp, node, inputs, attrs):
    op = node.op_type
    inputs = inputs + [None] * (8 - len(inputs))
    x, w, r, b, lengths, h0, c0, peep = inputs
    if not isinstance(x, Value) or not x.spec.sequence:
        raise Refused("X must be a batch of sequences (an input named in sequences=, or with dynamic batch "
                      "and time axes)")
    layout = attrs.get("layout", 0)
    if imp.axes_of(x) != (("T", "N") if layout == 0 else ("N", "T")) + (0,):
        raise Refused(f"X has axes {imp.axes_of(x)} for layout {layout}")
    w, r = const(w, "W"), const(r, "R")
    direction = text(attrs, "direction", "forward")
    hidden = attrs["hidden_size"]
    directions = 2 if direction == "bidirectional" else 1
    acts = [a.decode() if isinstance(a, bytes) else a for a in attrs.get("activations", [])]
    nonlinearity = "tanh"
    if op == "RNN" and acts and set(acts) == {"Relu"}:
        nonlinearity = "relu"
    elif acts and acts != DEFAULT_ACTIVATIONS[op] * directions:
        raise Refused(f"activations {acts}")
    if "clip" in attrs:
        raise Refused("clip")
    if attrs.get("input_forget", 0):
        raise Refused("input_forget=1")
    if lengths is not None:
        if not (isinstance(lengths, Value) and lengths.producer is None and lengths.spec.kind == "int32"
                and lengths.spec.shape == () and not lengths.spec.sequence):
            raise Refused("sequence_lens other than an input of one length per sequence")
        # the lengths of the Sequences lamina is fed: the input is read by lm.onnx.feeds, not the layers
        imp.length_inputs.add(lengths.name)
    _zero_or_absent(peep, "peepholes P")
    if w.shape[0] != directions:
        raise Refused(f"W holds {w.shape[0]} directions, direction={direction}")
    states = _initial_states(imp, [h0, c0] if op == "LSTM" else [h0], directions, hidden, layout)
    kind = {"LSTM": L.LSTM, "GRU": L.GRU, "RNN": L.RNN}[op]
    kw = {"nonlinearity": nonlinearity} if op == "RNN" else {}
    if op == "GRU":
        kw["linear_before_reset"] = bool(attrs.get("linear_before_reset", 0))
    layer = kind(x.spec.shape[0], hidden, bidirectional=directions == 2, reverse=direction == "reverse", **kw)
    for d in range(directions):
        sfx = layer._suffix(0, d)
        assign(layer, "weight_ih" + sfx, _reorder(w[d], op, hidden))
        assign(layer, "weight_hh" + sfx, _reorder(r[d], op, hidden))
        bias = const(b, "B")[d] if b is not None else np.zeros(2 * len(GATE_ORDER[op]) * hidden, np.float32)
        half = len(bias) // 2
        assign(layer, "bias_ih" + sfx, _reorder(bias[:half], op, hidden))
        assign(layer, "bias_hh" + sfx, _reorder(bias[half:], op, hidden))
    outs = imp.add(layer, [x] + states, node)
    y, last = outs[0], outs[1]
    results = []
    if node.output[0]:  # Y: [T, D, N, H] (layout 0) or [N, T, D, H]: per step lamina's [D·H] as [D, H]
        y = imp.net.add(L.Reshape((directions, hidden)), [y])
        y.onnx_axes = ("T", 0, "N", 1) if layout == 0 else ("N", "T", 0, 1)
    results.append(y if node.output[0] else None)
    for state in (last, outs[2] if op == "LSTM" else None):  # Y_h, Y_c: [D, N, H] or [N, D, H]
        if state is not None and layout == 0:
            state.onnx_axes = (0, "N", 1)
        results.append(state)
    return results
