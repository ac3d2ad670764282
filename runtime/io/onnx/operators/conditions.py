"""ONNX's comparisons, logic and Where: Greater, Less, GreaterOrEqual, LessOrEqual, Equal (a
lamina Compare of the operands' difference against 0), Not, And, Or, Xor (on masks), Cast of a
mask, Where (lamina's Where, a constant operand held as a frozen parameter), and Sign (Where
x > 0: 1, else where x < 0: -1, else x itself, so 0 and NaN stay as they are).

A comparison's result is a mask: a float value of 0 and 1 (marked `onnx_mask`), which Cast to a
number or to bool leaves as it is, and which is all that logic and Where take as a condition.
"""
import numpy as np

from .... import layers as L
from ....graph import Value
from ..registry import Refused, assign, bias_of, const, converter, fixed_bias, onnx_shape_text, value
from .arithmetic import _operands

# ONNX's comparison of a and b -> lamina's test of a - b against 0
TESTS = {"Greater": "greater", "Less": "less", "GreaterOrEqual": "greater_equal", "LessOrEqual": "less_equal",
         "Equal": "equal"}


def _mask(y):
    y.onnx_mask = True
    return y


def is_mask(x):
    return isinstance(x, Value) and getattr(x, "onnx_mask", False)


def _difference(imp, a, b):
    """a - b as a value, one operand a value and the other a value or a constant (broadcast over
    a sample)."""
    a, b = _operands(imp, [a, b])
    if isinstance(a, Value) and isinstance(b, Value):
        return imp.net.add(L.Add(), [a, imp.net.add(L.Scale(-1.0), [b])])
    if isinstance(b, Value):  # a constant minus a value
        x, c, negate = imp.net.add(L.Scale(-1.0), [b]), a, False
    else:
        x, c, negate = a, b, True
    c = const(c, "the constant operand").astype(np.float64)
    shift = bias_of(c, x.spec.shape, negate)
    if shift is None or not np.all(np.isfinite(shift)):
        raise Refused(f"a constant operand of shape {list(c.shape)} that is not finite or does not broadcast over "
                      f"one sample {onnx_shape_text(imp, x)}")
    return imp.net.add(fixed_bias(x.spec.shape, shift), [x]) if np.any(shift) else x


@converter(*TESTS)
def compare(imp, node, inputs, attrs):
    if not any(isinstance(x, Value) for x in inputs):
        raise Refused("a comparison of constants that did not fold")
    for i, x in enumerate(inputs):
        if isinstance(x, Value):
            value(x, f"input {i}")  # (floats only: integer values are refused there)
    return [_mask(imp.add(L.Compare(TESTS[node.op_type]), [_difference(imp, *inputs)], node))]


def _masks(inputs, op):
    for i, x in enumerate(inputs):
        if not is_mask(x):
            raise Refused(f"{op} of input {i}, which is not a comparison's result (lamina's logic takes masks)")
    return inputs


@converter("Not")
def logical_not(imp, node, inputs, attrs):
    (m,) = _masks(inputs, "Not")
    return [_mask(imp.add(L.Compare("less_equal"), [m], node))]


@converter("And")
def logical_and(imp, node, inputs, attrs):
    a, b = _operands(imp, _masks(inputs, "And"))
    return [_mask(imp.add(L.Multiply(), [a, b], node))]


@converter("Or", "Xor")
def logical_or(imp, node, inputs, attrs):
    """Or: a + b > 0; Xor: a - b ≠ 0, that is a + (-b) tested twice (0 where equal)."""
    a, b = _operands(imp, _masks(inputs, node.op_type))
    if node.op_type == "Or":
        return [_mask(imp.add(L.Compare("greater"), [imp.net.add(L.Add(), [a, b])], node))]
    equal = imp.net.add(L.Compare("equal"), [_difference(imp, a, b)])
    return [_mask(imp.add(L.Compare("less_equal"), [equal], node))]


def cast_mask(imp, node, x, to):
    """Cast of a mask to a number or to bool: the mask itself; Cast of a float value to bool:
    x ≠ 0. None where neither applies."""
    tp = imp.onnx.TensorProto
    if is_mask(x) and to in (tp.BOOL, tp.FLOAT, tp.DOUBLE, tp.FLOAT16):
        return x
    if isinstance(x, Value) and x.spec.kind == "float" and to == tp.BOOL:
        equal = imp.net.add(L.Compare("equal"), [x])
        return _mask(imp.add(L.Compare("less_equal"), [equal], node))
    return None


@converter("Where")
def where(imp, node, inputs, attrs):
    """Where(cond, a, b): cond a mask or a constant, a and b values or constants (finite), all
    broadcast over one sample."""
    cond, a, b = inputs
    if isinstance(cond, Value) and not is_mask(cond):
        raise Refused("a condition that is not a comparison's result (lamina's Where takes masks)")
    values = [x for x in (cond, a, b) if isinstance(x, Value)]
    if not values:
        raise Refused("Where of constants that did not fold")
    for x in values:
        value(x, "an operand")
    shape = values[0].spec.shape
    if any(x.spec.shape != shape or x.spec.sequence != values[0].spec.sequence for x in values):
        raise Refused(f"operands of shapes {', '.join(onnx_shape_text(imp, x) for x in values)} (lamina's Where takes "
                      f"values of one shape)")
    fixed = {k: x for k, x in zip(("cond", "a", "b"), (cond, a, b)) if not isinstance(x, Value)}
    layer = L.Where(shape, fixed=fixed)
    for k, x in fixed.items():
        c = const(x, k).astype(np.float64)
        if k == "cond":
            c = (c != 0).astype(np.float64)
        full = bias_of(c, shape, False)
        if full is None:
            raise Refused(f"{k} of shape {list(c.shape)} does not broadcast over one sample {list(shape)}")
        assign(layer, k, full.reshape(layer.params[k].shape))
    y = imp.add(layer, [x for x in (cond, a, b) if isinstance(x, Value)], node)
    if all(is_mask(x) or (isinstance(x, np.ndarray) and np.all(np.isin(x, (0, 1)))) for x in (a, b)):
        _mask(y)
    return [y]


@converter("Sign")
def sign(imp, node, inputs, attrs):
    x = value(inputs[0], "input")
    shape = x.spec.shape

    def branch(test, constant, otherwise, named):
        layer = L.Where(shape, fixed=("a",))
        assign(layer, "a", np.full(layer.params["a"].shape, constant))
        mask = imp.net.add(L.Compare(test), [x])
        return imp.add(layer, [mask, otherwise], node) if named else imp.net.add(layer, [mask, otherwise])
    return [branch("greater", 1.0, branch("less", -1.0, x, False), True)]
