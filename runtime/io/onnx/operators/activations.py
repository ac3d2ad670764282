"""ONNX's pass-through and element-wise operators: Identity, Dropout, Cast, the activations
(lamina's Activation kinds, and Celu and Mish composed of them), Neg, Clip, PRelu, Softmax and
LogSoftmax."""
import math

import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from . import conditions
from ..registry import Refused, fixed_bias, assign, bias_of, const, converter, text, value


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
    identity here: lamina holds ids as int32 and floats in the network's type. Masks (comparisons'
    results) cast to numbers or bool as they are, and a float value to bool is x ≠ 0."""
    x = inputs[0]
    tp = imp.onnx.TensorProto
    ints = {tp.INT8, tp.INT16, tp.INT32, tp.INT64, tp.UINT8, tp.UINT16, tp.UINT32}
    floats = {tp.FLOAT, tp.DOUBLE, tp.FLOAT16}
    to = attrs["to"]
    mask = conditions.cast_mask(imp, node, x, to)
    if mask is not None:
        return [mask]
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


@converter("Celu", attributes={"alpha"})
def celu(imp, node, inputs, attrs):
    """max(0, x) + min(0, α(exp(x/α) - 1)) = α · elu(x / α) with elu's α 1."""
    x = value(inputs[0], "X")
    alpha = float(attrs.get("alpha", 1.0))
    if not (math.isfinite(alpha) and alpha > 0):
        raise Refused(f"alpha {alpha} (must be a finite number above 0)")
    if alpha == 1.0:
        return [imp.add(L.Activation("elu", slope=1.0), [x], node)]
    y = imp.net.add(L.Activation("elu", slope=1.0), [imp.net.add(L.Scale(1.0 / alpha), [x])])
    return [imp.add(L.Scale(alpha), [y], node)]


@converter("Mish")
def mish(imp, node, inputs, attrs):
    """x · tanh(softplus(x))."""
    x = value(inputs[0], "X")
    t = imp.net.add(L.Activation("tanh"), [imp.net.add(L.Activation("softrelu"), [x])])
    return [imp.add(L.Multiply(), [x, t], node)]


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
    return last(fixed_bias(y.spec.shape, lo), y)


def _bound(given, attribute, name, default):
    """One of Clip's bounds as a float: its input, its attribute (opset < 11) or the default."""
    if given is None:
        return float(attribute) if attribute is not None else default
    bound = const(given, name)
    if bound.size != 1:
        raise Refused(f"{name} must be a scalar, found shape {list(bound.shape)}")
    return float(bound.reshape(()))


def _shift(imp, x, amount):
    return imp.net.add(fixed_bias(x.spec.shape, amount), [x])


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
    full = bias_of(slope, x.spec.shape, negate=False)  # slope over one sample's shape
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
