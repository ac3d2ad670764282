"""Quantized ONNX models: ONNX Runtime's dynamic quantization and QDQ models.

- Dynamic (`onnxruntime.quantization.quantize_dynamic`): DynamicQuantizeLinear(x) gives x's u8
  values, scale and zero point; MatMulInteger / ConvInteger multiply them with an int8 (or u8)
  weight and its zero point; the int32 result is Cast to float and multiplied by the product of
  the two scales. LSTMs become com.microsoft's DynamicQuantizeLSTM over int8 W and R.
- QDQ: QuantizeLinear -> DequantizeLinear pairs on activations (the rounding a quantized runtime
  would do) and DequantizeLinear of int8 weight initializers (folded like any constant) around
  float MatMul / Gemm / Conv. A pair whose range starts at 0 (the zero point at the type's
  lowest value) also clips at 0: a quantizer folds a Relu into it that way, and lamina keeps it
  as a Relu. Its saturation at the calibrated range's other end is the quantizer's estimate of
  where values lie, not part of the model's function: lamina does not clip there.

lamina imports each as the float operator over the dequantized weights, and the network then
multiplies in int8 (lamina.precision): lamina quantizes the weights per output channel and each
row of the activations itself, so the computation is the same kind and its grid at least as fine
as ONNX Runtime's (per-tensor activations), though not its numbers bit for bit.

Between the nodes of such a pattern the importer's environment holds markers (below) in place of
values: what a tensor stands for. A marker that reaches any other operator is refused by name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from ...graph import Value
from .operators import dense, recurrent, volumes
from .registry import Refused, fixed_bias


@dataclass(eq=False)
class Quantized:
    """The u8 values of DynamicQuantizeLinear(x)."""
    x: Value


@dataclass(eq=False)
class Scale:
    """The scale of DynamicQuantizeLinear(x)."""
    x: Value


@dataclass(eq=False)
class ZeroPoint:
    """The zero point of DynamicQuantizeLinear(x)."""
    x: Value


@dataclass(eq=False)
class IntegerProduct:
    """MatMulInteger / ConvInteger of Quantized(x) and an integer weight (less its zero point):
    ~ (x's product with the weight) / (x's scale x the weight's scale), made a layer when the
    scales are multiplied back in. `conv` holds ConvInteger's node and attributes."""
    x: Value
    weight: np.ndarray
    node: Any
    conv: Optional[dict] = None


@dataclass(eq=False)
class ProductScale:
    """Scale(x) times the weight's scale (a scalar, or one per output channel)."""
    x: Value
    weight_scale: np.ndarray


@dataclass(eq=False)
class FakeQuantized:
    """QuantizeLinear(x, scale, zero point) of a value: DequantizeLinear with the same parameters
    gives x back within the grid, which lamina's int8 products apply themselves."""
    x: Value
    scale: np.ndarray
    zero_point: Optional[np.ndarray]


MARKERS = (Quantized, Scale, ZeroPoint, IntegerProduct, ProductScale, FakeQuantized)
# (domain, operator) -> converter; Cast and Mul come here only when they read a marker
CONVERTERS: dict = {}


def converter(op_type, domain=""):
    def register(fn):
        CONVERTERS[(domain, op_type)] = fn
        return fn
    return register


# operators converted here only when they read a marker (otherwise they are ordinary ones)
ON_MARKERS = ("Cast", "Mul")


def handles(node, inputs) -> bool:
    """Whether this module converts the node: any node reading a marker, or a quantization
    operator (one of CONVERTERS but for ON_MARKERS)."""
    if any(isinstance(v, MARKERS) for v in inputs):
        return True
    return (node.domain or "", node.op_type) in CONVERTERS and node.op_type not in ON_MARKERS


def convert(imp, node, inputs, attrs):
    fn = CONVERTERS.get((node.domain or "", node.op_type))
    if fn is None:
        kind = next(type(v).__name__ for v in inputs if isinstance(v, MARKERS))
        raise Refused(f"reads a quantized tensor ({kind}); lamina imports quantized tensors only into the "
                      f"patterns of ONNX Runtime's quantizer (MatMulInteger, ConvInteger, Cast, Mul, "
                      f"DequantizeLinear)")
    imp.quantized = True
    return fn(imp, node, inputs + [None] * (8 - len(inputs)), attrs)


def _const(x, what):
    if not isinstance(x, np.ndarray):
        raise Refused(f"{what} must be a constant (an initializer)")
    return x


def _integers(q, zero_point, what, axis):
    """q less its zero point as float32 integers; the zero point is a scalar or one per output
    channel, q's axis `axis`."""
    q = _const(q, what)
    if q.dtype not in (np.int8, np.uint8):
        raise Refused(f"{what} must be int8 or uint8, found {q.dtype}")
    z = np.zeros((), np.float32) if zero_point is None else _const(zero_point, f"{what}'s zero point").astype(np.float32)
    if z.size > 1:
        if z.ndim != 1 or q.ndim <= axis or z.shape[0] != q.shape[axis]:
            raise Refused(f"{what}'s zero point of shape {list(z.shape)} is neither one value nor one per output "
                          f"channel of {list(q.shape)}")
        z = z.reshape([-1 if i == axis else 1 for i in range(q.ndim)])
    return q.astype(np.float32) - (z if z.size > 1 else z.reshape(()))


@converter("DynamicQuantizeLinear")
def dynamic_quantize_linear(imp, node, inputs, attrs):
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("DynamicQuantizeLinear of a constant or of integers")
    return [Quantized(x), Scale(x), ZeroPoint(x)]


@converter("MatMulInteger")
def matmul_integer(imp, node, inputs, attrs):
    a, b, a_zero, b_zero = inputs[:4]
    if not isinstance(a, Quantized) or not (a_zero is None or isinstance(a_zero, ZeroPoint) and a_zero.x is a.x):
        raise Refused("A must be DynamicQuantizeLinear's output, with its own zero point")
    if isinstance(b, np.ndarray) and b.ndim != 2:
        raise Refused(f"B must be [K, M], found {list(b.shape)}")
    return [IntegerProduct(a.x, _integers(b, b_zero, "B", axis=1), node)]


@converter("ConvInteger")
def conv_integer(imp, node, inputs, attrs):
    x, w, x_zero, w_zero = inputs[:4]
    if not isinstance(x, Quantized) or not (x_zero is None or isinstance(x_zero, ZeroPoint) and x_zero.x is x.x):
        raise Refused("X must be DynamicQuantizeLinear's output, with its own zero point")
    return [IntegerProduct(x.x, _integers(w, w_zero, "W", axis=0), node, conv=attrs)]


@converter("Cast")
def cast(imp, node, inputs, attrs):
    product = inputs[0]
    if not isinstance(product, IntegerProduct) or attrs.get("to") != imp.onnx.TensorProto.FLOAT:
        raise Refused("a cast of a quantized tensor other than an integer product to float")
    return [product]


@converter("Mul")
def mul(imp, node, inputs, attrs):
    a, b = inputs[:2]
    if isinstance(b, Scale) or isinstance(b, IntegerProduct):
        a, b = b, a
    if isinstance(a, Scale) and isinstance(b, np.ndarray):
        return [ProductScale(a.x, b.astype(np.float32))]
    if isinstance(a, IntegerProduct) and isinstance(b, ProductScale) and b.x is a.x:
        return [_dequantized_layer(imp, node, a, b.weight_scale)]
    raise Refused("a product of quantized tensors other than the scales ONNX Runtime's quantizer multiplies in")


def _dequantized_layer(imp, node, product, weight_scale):
    """The float layer of an integer product, over the weight times its scale."""
    if product.conv is None:
        scale = weight_scale.reshape(-1) if weight_scale.size > 1 else weight_scale.reshape(())
        if scale.ndim == 1 and scale.shape[0] != product.weight.shape[1]:
            raise Refused(f"{scale.shape[0]} weight scales for {product.weight.shape[1]} output columns")
        out = dense.matmul(imp, product.node, [product.x, product.weight * scale], {})[0]
        imp.linear_of[node.output[0]] = imp.linear_of.pop(product.node.output[0])  # (a following Add is its bias)
        return out
    scale = weight_scale.reshape(-1, *([1] * (product.weight.ndim - 1))) if weight_scale.size > 1 else weight_scale
    return volumes.conv(imp, product.node, [product.x, product.weight * scale], product.conv)[0]


@converter("QuantizeLinear")
def quantize_linear(imp, node, inputs, attrs):
    x, scale, zero_point = inputs[:3]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("QuantizeLinear of a value lamina does not hold as floats")
    return [FakeQuantized(x, _const(scale, "y_scale"), None if zero_point is None else _const(zero_point, "y_zero_point"))]


@converter("DequantizeLinear")
def dequantize_linear(imp, node, inputs, attrs):
    q, scale, zero_point = inputs[:3]
    if isinstance(q, Value):  # integers gathered from a quantized table (an embedding): (q - z) · s
        return [_dequantized_value(imp, node, q, _const(scale, "x_scale"), zero_point)]
    if not isinstance(q, FakeQuantized):
        raise Refused("DequantizeLinear of a value not quantized by QuantizeLinear (a quantized model input?)")
    same = np.array_equal(q.scale, _const(scale, "x_scale")) and (
        (q.zero_point is None and (zero_point is None or not np.any(zero_point)))
        or (q.zero_point is not None and zero_point is not None and np.array_equal(q.zero_point, zero_point)))
    if not same:
        raise Refused("DequantizeLinear with another scale or zero point than the QuantizeLinear before it")
    zero = q.zero_point if q.zero_point is not None else np.zeros((), np.uint8)
    lowest = np.iinfo(zero.dtype).min if zero.dtype.kind in "iu" else None
    if lowest is not None and np.all(zero.astype(np.int64) == lowest) and np.all(q.scale > 0):
        from ... import layers as L
        return [imp.add(L.Activation("relu"), [q.x], node)]  # the range [0, ...]: a folded Relu
    return [q.x]


def _dequantized_value(imp, node, q, scale, zero_point):
    """(q - zero point) · scale of a value, one scale and zero point for the whole tensor (as
    ONNX Runtime quantizes an embedding table, whose rows a Gather then picks)."""
    from ... import layers as L
    if q.spec.kind != "float" or scale.size != 1 or (zero_point is not None and np.size(zero_point) != 1):
        raise Refused("DequantizeLinear of a value takes one scale and zero point for the whole tensor")
    zero = 0.0 if zero_point is None else float(_const(zero_point, "x_zero_point").reshape(()))
    axes = getattr(q, "onnx_axes", None)  # (a value transposed before: its axes stay as they were)
    if zero:
        q = imp.net.add(fixed_bias(q.spec.shape, -zero), [q])
    out = imp.add(L.Scale(float(scale.reshape(()))), [q], node)
    if axes is not None:
        out.onnx_axes = axes
    return out


@converter("DynamicQuantizeLSTM", domain="com.microsoft")
def dynamic_quantize_lstm(imp, node, inputs, attrs):
    """An LSTM whose W [D, input, 4H] and R [D, H, 4H] are int8 with scales and zero points (one
    per direction, or per column): the ONNX LSTM over the dequantized, transposed weights."""
    padded = inputs + [None] * (12 - len(inputs))
    x, w, r, b, lengths, h0, c0, peep, w_scale, w_zero, r_scale, r_zero = padded[:12]
    weights = []
    for q, scale, zero, what in ((w, w_scale, w_zero, "W"), (r, r_scale, r_zero, "R")):
        q = _const(q, what)
        if q.ndim != 3:
            raise Refused(f"{what} must be [directions, rows, 4·hidden], found {list(q.shape)}")
        shape = (q.shape[0], 1, -1)
        zero = np.zeros(1, np.float32) if zero is None else _const(zero, f"{what}'s zero point").astype(np.float32)
        deq = (q.astype(np.float32) - zero.reshape(shape)) * _const(scale, f"{what}'s scale").astype(np.float32).reshape(shape)
        weights.append(np.ascontiguousarray(deq.transpose(0, 2, 1)))  # ONNX LSTM's [D, 4H, rows]
    lstm = imp.onnx.helper.make_node("LSTM", [], list(node.output), name=node.name)
    return recurrent.recurrent(imp, lstm, [x, *weights, b, lengths, h0, c0, peep], attrs)
