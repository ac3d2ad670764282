"""ONNX's operators on [N, C, *spatial]: Resize, Upsample, Conv, ConvTranspose, the pools,
ReduceMean over the spatial axes, BatchNormalization (1-D forms run as 2-D of height 1)."""
import math

import numpy as np

from .... import layers as L
from ....layers.resize import COORDINATES, PAD_MODES, ROUNDINGS, padding_table
from ....graph import Value
from .. import shapes
from . import pool_indices
from ..registry import (Refused, assign, bounded_sample, const, converter, default_axes, fixed_bias,
                        onnx_shape_text, text, value)


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
        if sizes is not None and np.size(shapes.entries(sizes)):
            full = ["N"] + list(x.spec.shape)
            for a, n in zip(axes, shapes.entries(sizes).reshape(-1)):
                full[a] = n
            sizes = shapes.Symbolic(full)
    coordinates = text(attrs, "coordinate_transformation_mode", "half_pixel" if imp.opset >= 11 else "asymmetric")
    return [_resized(imp, node, x, text(attrs, "mode", "nearest"), coordinates,
                     text(attrs, "nearest_mode", "round_prefer_floor"), scales, sizes)]


@converter("Pad", attributes={"mode", "pads", "value"})
def pad(imp, node, inputs, attrs):
    """lamina's Pad over a value's own axes (the batch and time axes stay unpadded): pads from the
    input (opset 11) or the attribute, opset 18's axes, modes constant (a non-zero value added
    outside the input as a fixed bias), edge, reflect and wrap."""
    x = value(inputs[0], "data")
    mode = text(attrs, "mode", "constant")
    if mode not in PAD_MODES:
        raise Refused(f"mode {mode!r}")
    layout = imp.axes_of(x)
    rank = len(layout)
    pads = shapes.constant_ints(inputs[1], "pads") if len(inputs) > 1 and inputs[1] is not None else attrs.get("pads")
    if pads is None:
        raise Refused("no pads")
    axes = (shapes.constant_ints(inputs[3], "axes") if len(inputs) > 3 and inputs[3] is not None
            else list(range(rank)))
    axes = [a + rank if a < 0 else a for a in axes]
    if len(pads) != 2 * len(axes) or not all(0 <= a < rank for a in axes):
        raise Refused(f"pads {list(pads)} for axes {axes} of a rank-{rank} value")
    per_axis = [(0, 0)] * len(x.spec.shape)
    for a, before, after in zip(axes, pads[:len(axes)], pads[len(axes):]):
        if isinstance(layout[a], str):
            if before or after:
                raise Refused(f"pads {before}, {after} on the {'batch' if layout[a] == 'N' else 'time'} axis")
            continue
        per_axis[layout[a]] = (before, after)
    fill = 0.0
    if len(inputs) > 2 and inputs[2] is not None and np.size(inputs[2]):
        fill = float(const(inputs[2], "constant_value").reshape(-1)[0])
    elif "value" in attrs:
        fill = float(attrs["value"])
    bounded_sample([n + b + a for n, (b, a) in zip(x.spec.shape, per_axis)], "an output")
    fill = fill if mode == "constant" else 0.0
    y = imp.add(L.Pad(per_axis, mode=mode), [x], node) if not fill else imp.net.add(L.Pad(per_axis, mode=mode), [x])
    if fill:  # the value outside the input: a fixed bias there
        inside = np.ones(())
        for n, (before, after) in zip(x.spec.shape, per_axis):
            inside = np.multiply.outer(inside, padding_table(n, before, after, "constant")[1][:, 0])
        y = imp.add(fixed_bias(y.spec.shape, fill * (1.0 - inside)), [y], node)
    return [y]


@converter("Upsample", attributes={"mode", "scales"})
def upsample(imp, node, inputs, attrs):
    """ONNX's Upsample (before Resize): scales from the attribute (opset 7) or the input (9),
    asymmetric coordinates, nearest neighbours rounded down as ONNX defines it."""
    x = value(inputs[0], "X")
    scales = inputs[1] if len(inputs) > 1 else np.asarray(attrs.get("scales", []), np.float32)
    return [_resized(imp, node, x, text(attrs, "mode", "nearest"), "asymmetric", "floor", scales, None)]


def _resized(imp, node, x, mode, coordinates, rounding, scales, sizes):
    mode = {"bilinear": "linear", "trilinear": "linear"}.get(mode, mode)
    if mode not in ("nearest", "linear"):
        raise Refused(f"mode {mode!r} (lamina resizes by nearest neighbours or linearly)")
    if coordinates not in COORDINATES:
        raise Refused(f"coordinate_transformation_mode {coordinates!r}")
    if rounding not in ROUNDINGS:
        raise Refused(f"nearest_mode {rounding!r}")
    spatial = x.spec.shape[1:]
    given_scales = None
    if isinstance(sizes, (np.ndarray, shapes.Symbolic)) and np.size(shapes.entries(sizes)):
        full = list(shapes.entries(sizes))
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
    bounded_sample([x.spec.shape[0]] + size, "an output")
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
        if len(node.output) > 1 and node.output[1]:
            raise Refused("the Indices output of a pool over [N, C, L]")
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
    """kernel, stride, (before, after) padding pairs, ceil_mode and dilation of a pool node."""
    kernel = tuple(attrs["kernel_shape"])
    stride = tuple(attrs.get("strides", [1] * nd))
    dilation = tuple(attrs.get("dilations", [1] * nd))
    padding = _pads(attrs, nd, x.spec.shape[1:], kernel, stride, dilation, asymmetric=True)
    span = [(k - 1) * d + 1 for k, d in zip(kernel, dilation)]
    if any(2 * p > k for pair, k in zip(padding, span) for p in pair):
        raise Refused(f"padding {[list(p) for p in padding]} more than half the kernel {list(kernel)}"
                      f"{f' dilated {list(dilation)}' if max(dilation, default=1) > 1 else ''}")
    return kernel, stride, padding, bool(attrs.get("ceil_mode", 0)), dilation


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
    """With the Indices output: lamina's return_indices (operators/pool_indices.py says how the
    two count positions)."""
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    indexed = len(node.output) > 1 and bool(node.output[1])
    if indexed and attrs.get("storage_order", 0):
        raise Refused("storage_order=1 (Indices counted column-major)")
    kernel, stride, padding, ceil_mode, dilation = _pool_window(imp, node, x, attrs, nd)
    if indexed and max(kernel + stride + dilation) == 1 and not any(p for pair in padding for p in pair):
        return pool_indices.pooled(imp, node, x, None, None, identity=True)
    out = _pool(imp, node, x, L.MaxPool2d if nd == 2 else L.MaxPool3d, kernel, stride, padding, ceil_mode,
                dilation=dilation, return_indices=indexed)
    return pool_indices.pooled(imp, node, x, *out, identity=False) if indexed else [out]


@converter("AveragePool", attributes={"auto_pad", "ceil_mode", "count_include_pad", "dilations",
                                        "kernel_shape", "pads", "strides"})
@lifted_to_2d
def average_pool(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    kernel, stride, padding, ceil_mode, dilation = _pool_window(imp, node, x, attrs, nd)
    return [_pool(imp, node, x, L.AvgPool2d if nd == 2 else L.AvgPool3d, kernel, stride, padding,
                  count_include_pad=bool(attrs.get("count_include_pad", 0)), ceil_mode=ceil_mode, dilation=dilation)]


@converter("GlobalAveragePool", "GlobalMaxPool")
@lifted_to_2d
def global_pool(imp, node, inputs, attrs):
    x = value(inputs[0], "X")
    nd = _spatial(imp, x, "X")
    spatial = x.spec.shape[1:]
    pools = (L.AvgPool2d, L.AvgPool3d) if node.op_type == "GlobalAveragePool" else (L.MaxPool2d, L.MaxPool3d)
    layer = pools[nd - 2](spatial, spatial, 0)
    return [imp.add(layer, [x], node)]


@converter("ReduceMax", attributes={"axes", "keepdims", "noop_with_empty_axes"})
def reduce_max(imp, node, inputs, attrs):
    """The largest value over every spatial axis of [N, C, *spatial] (a global max pool, what
    `x.amax((2, 3))` exports), or over each sequence's steps (a SequencePool)."""
    x = value(inputs[0], "data")
    layout = imp.axes_of(x)
    rank = len(layout)
    axes = shapes.constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
    axes = sorted(a + rank if a < 0 else a for a in axes or [])
    keep = attrs.get("keepdims", 1)
    if x.spec.sequence and [layout[a] for a in axes] == ["T"] and not keep:
        y = imp.add(L.SequencePool("max"), [x], node)
        if tuple(a for a in layout if a != "T") != default_axes(y.spec):
            y.onnx_axes = tuple(a for a in layout if a != "T")
        return [y]
    spatial = x.spec.shape[1:]
    if x.spec.sequence or layout != default_axes(x.spec) or not 1 <= len(spatial) <= 3 or \
            axes != list(range(2, rank)):
        raise Refused(f"ReduceMax over axes {axes} of {onnx_shape_text(imp, x)} (lamina takes the maximum over "
                      f"every spatial axis of [N, C, spatial...], or over a sequence's steps)")
    lifted = imp.net.add(L.Reshape((x.spec.shape[0], 1, spatial[0])), [x]) if len(spatial) == 1 else x
    window = lifted.spec.shape[1:]
    pooled = imp.net.add((L.MaxPool3d if len(window) == 3 else L.MaxPool2d)(window, window, 0), [lifted])
    shape = (x.spec.shape[0],) + (1,) * len(spatial) if keep else (x.spec.shape[0],)
    return [imp.add(L.Reshape(shape), [pooled], node)]


@converter("ReduceMean", "ReduceSum", attributes={"axes", "keepdims", "noop_with_empty_axes"})
def reduce_mean_sum(imp, node, inputs, attrs):
    """The mean or sum over a value's own axes: over every spatial axis of [N, C, *spatial] a mean is
    a global average pool (what PyTorch's exporter writes for AdaptiveAvgPool(1)); otherwise
    lamina's Reduce, then a Reshape dropping the axes unless keepdims."""
    x = value(inputs[0], "data")
    layout = imp.axes_of(x)
    rank = len(layout)
    axes = shapes.constant_ints(inputs[1], "axes") if len(inputs) > 1 and inputs[1] is not None else attrs.get("axes")
    if not axes:
        if attrs.get("noop_with_empty_axes", 0):
            return [imp.add(L.Scale(1.0), [x], node)]
        axes = list(range(rank))
    axes = sorted(a + rank if a < 0 else a for a in axes)
    if not all(0 <= a < rank for a in axes) or len(set(axes)) != len(axes):
        raise Refused(f"axes {axes} of a rank-{rank} value")
    if x.spec.sequence and [layout[a] for a in axes] == ["T"]:
        return [_over_time(imp, node, x, layout, attrs.get("keepdims", 1))]
    if any(isinstance(layout[a], str) for a in axes):
        raise Refused(f"axes {axes} include the batch or time axis (lamina reduces within each sample)")
    own = [layout[a] for a in axes]
    keep = attrs.get("keepdims", 1)
    if node.op_type == "ReduceMean" and not x.spec.sequence and layout == default_axes(x.spec) and \
            len(x.spec.shape) in (3, 4) and own == list(range(1, len(x.spec.shape))):
        return [_global_average(imp, node, x, keep)]
    kept = [k for k in range(len(x.spec.shape)) if k not in own]
    if not keep and not kept:
        raise Refused(f"axes {axes}: every axis of a sample reduced without keepdims (lamina keeps one)")
    y = imp.add(L.Reduce(own, mode="mean" if node.op_type == "ReduceMean" else "sum"), [x], node)
    return [y if keep else imp.net.add(L.Reshape(tuple(x.spec.shape[k] for k in kept)), [y])]


def _over_time(imp, node, x, layout, keep):
    """The mean or sum over each sequence's steps: a SequencePool (each sequence over its own
    length: padding is never counted)."""
    if keep:
        raise Refused("keepdims=1 over the time axis (lamina's pooled value has no time axis)")
    y = imp.add(L.SequencePool("average" if node.op_type == "ReduceMean" else "sum"), [x], node)
    rest = tuple(a for a in layout if a != "T")
    if rest != default_axes(y.spec):
        y.onnx_axes = rest
    return y


def _global_average(imp, node, x, keep):
    spatial = x.spec.shape[1:]
    y = imp.add((L.AvgPool2d if len(spatial) == 2 else L.AvgPool3d)(spatial, spatial, 0), [x], node)
    return y if keep else imp.net.add(L.Reshape((x.spec.shape[0],)), [y])


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
