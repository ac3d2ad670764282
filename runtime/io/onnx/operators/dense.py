"""ONNX's Gemm and MatMul as lamina's Linear."""
import numpy as np

from .... import layers as L
from ..registry import Refused, assign, const, converter, onnx_shape_text, value


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
