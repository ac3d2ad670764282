"""ONNX's LayerNormalization and RMSNormalization as lamina's LayerNorm and RMSNorm;
InstanceNormalization and GroupNormalization as a LayerNorm of each group's values (a Reshape
to [groups, values], the norm without weights, a Reshape back) and a per-channel affine."""
import math

import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from ..registry import Refused, assign, const, converter, default_axes, onnx_shape_text


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


@converter("InstanceNormalization", attributes={"epsilon"})
def instance_norm(imp, node, inputs, attrs):
    x = _channels_first(imp, inputs[0], "input")
    return [_group_norm(imp, node, x, x.spec.shape[0], inputs[1], inputs[2], float(attrs.get("epsilon", 1e-5)),
                        per_group=False)]


@converter("GroupNormalization", attributes={"epsilon", "num_groups", "stash_type"})
def group_norm(imp, node, inputs, attrs):
    """Opset 18's scale and bias hold one value per group, opset 21's one per channel."""
    x = _channels_first(imp, inputs[0], "X")
    if attrs.get("stash_type", 1) != 1:
        raise Refused(f"stash_type={attrs['stash_type']} (lamina computes the statistics in float32 or wider)")
    groups = int(attrs["num_groups"])
    return [_group_norm(imp, node, x, groups, inputs[1], inputs[2], float(attrs.get("epsilon", 1e-5)),
                        per_group=imp.opset < 21)]


def _channels_first(imp, x, what):
    if not isinstance(x, Value) or x.spec.kind != "float" or x.spec.sequence:
        raise Refused(f"{what} must be float values [N, C, ...] computed from the model's inputs")
    if getattr(x, "onnx_axes", None) not in (None, default_axes(x.spec)) or len(x.spec.shape) < 2:
        raise Refused(f"{what} {onnx_shape_text(imp, x)}: lamina normalises [N, C, spatial...] with the batch first")
    return x


def _group_norm(imp, node, x, groups, scale, bias, eps, per_group):
    channels, spatial = x.spec.shape[0], x.spec.shape[1:]
    if groups < 1 or channels % groups:
        raise Refused(f"{groups} groups of {channels} channels (the groups must divide the channels)")
    size = channels // groups * math.prod(spatial)
    rows = imp.net.add(L.Reshape((groups, size)), [x])
    normed = imp.net.add(L.LayerNorm(size, eps=eps, elementwise_affine=False), [rows])
    y = imp.net.add(L.Reshape(x.spec.shape), [normed])
    width = groups if per_group else channels
    values = []
    for v, what in ((scale, "scale"), (bias, "B")):
        v = np.asarray(const(v, what), np.float64).reshape(-1)
        if v.size != width:
            raise Refused(f"{what} holds {v.size} values, expected {width} (one per "
                          f"{'group' if per_group else 'channel'})")
        values.append(np.repeat(v, channels // groups) if per_group else v)
    return channel_affine(imp, node, y, *values)


def channel_affine(imp, node, x, scale, bias):
    """x[:, c] * scale[c] + bias[c] over a sample [C, spatial...] (either may be None), as a
    depthwise convolution of kernel 1 (1-D samples as 2-D of height 1) and a Bias: parameters
    per channel, as PyTorch's; nothing where scale is ones and bias zeros."""
    channels, spatial = x.spec.shape[0], x.spec.shape[1:]
    if scale is not None and np.all(scale == 1):
        scale = None
    if bias is not None and not np.any(bias):
        bias = None
    if scale is None and bias is None:
        return x
    if scale is None:
        layer = L.Bias(x.spec.shape)
        assign(layer, "bias", np.broadcast_to(bias.reshape((channels,) + (1,) * len(spatial)), x.spec.shape))
        return imp.add(layer, [x], node) if node is not None else imp.net.add(layer, [x])
    if len(spatial) not in (1, 2, 3):
        raise Refused(f"a per-channel scale over samples {list(x.spec.shape)} (lamina takes 1 to 3 spatial axes)")
    flat = len(spatial) == 1
    conv = (L.Conv3d if len(spatial) == 3 else L.Conv2d)(channels, channels, 1, groups=channels, bias=bias is not None)
    assign(conv, "weight", scale.reshape((channels, 1) + (1,) * max(len(spatial), 2)))
    if bias is not None:
        assign(conv, "bias", bias)
    h = imp.net.add(L.Reshape((channels, 1, spatial[0])), [x]) if flat else x
    last = flat or node is None
    y = imp.net.add(conv, [h]) if last else imp.add(conv, [h], node)
    if flat:
        y = imp.add(L.Reshape(x.spec.shape), [y], node) if node is not None else imp.net.add(L.Reshape(x.spec.shape), [y])
    return y
