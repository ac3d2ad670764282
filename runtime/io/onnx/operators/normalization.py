"""ONNX's LayerNormalization and RMSNormalization as lamina's LayerNorm and RMSNorm."""
import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from ..registry import Refused, assign, const, converter, onnx_shape_text


@converter("LayerNormalization", "RMSNormalization", attributes={"axis", "epsilon", "stash_type"})
def layer_norm(imp, node, inputs, attrs):
    """Over the axes from `axis` to the last, which must be a sample's trailing axes (in any
    layout of the batch and time axes before them); Scale (and B) broadcast to those axes."""
    x = inputs[0]
    if not isinstance(x, Value) or x.spec.kind != "float":
        raise Refused("X must be float values computed from the model's inputs")
    if len(node.output) > 1 and any(imp.uses.get(o) for o in node.output[1:] if o):
        raise Refused("the Mean or InvStdDev output is used (lamina keeps them inside the layer)")
    if attrs.get("stash_type", 1) != 1:
        raise Refused(f"stash_type={attrs['stash_type']} (lamina computes the statistics in float32 or wider)")
    axis = attrs.get("axis", -1)
    first = shapes.along(imp, x, axis, "axis")
    layout = imp.axes_of(x)
    trailing = tuple(layout[layout.index(first):])
    if trailing != tuple(range(first, len(x.spec.shape))):
        raise Refused(f"axis {axis} of X {onnx_shape_text(imp, x)}: the normalized axes must be a sample's last ones")
    normalized = x.spec.shape[first:]
    rms = node.op_type == "RMSNormalization"
    eps = float(attrs.get("epsilon", 1e-5))
    layer = L.RMSNorm(normalized, eps=eps) if rms else L.LayerNorm(normalized, eps=eps, bias=len(inputs) > 2 and
                                                                   inputs[2] is not None)
    for name, v in (("weight", inputs[1]), ("bias", inputs[2] if len(inputs) > 2 else None)):
        if v is not None and name in layer.params:
            values = const(v, "Scale" if name == "weight" else "B")
            try:
                assign(layer, name, np.broadcast_to(values, normalized))
            except ValueError:
                raise Refused(f"{'Scale' if name == 'weight' else 'B'} of shape {list(values.shape)} does not "
                              f"broadcast to the normalized axes {list(normalized)}") from None
    y = imp.add(layer, [x], node)
    if getattr(x, "onnx_axes", None):
        y.onnx_axes = x.onnx_axes
    return [y]
