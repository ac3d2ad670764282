"""lamina Network → ONNX (opset 18, or 20 where a GELU needs ONNX's Gelu): the inference graph
of the outputs that need no labels.

Each input gets a dynamic first axis ('batch') before its per-sample shape; a sequence input is
a padded [batch, time, ...] tensor, and the model takes one more input, `lengths` (int64
[batch]), which the recurrent nodes read as sequence_lens (values past each length are padding:
ONNX Runtime zeroes the recurrent outputs there). Each layer becomes one or a few standard ONNX
nodes, its parameters initializers. Costs (and the outputs that need them) are training-only and
left out; a score (a cost layer built with objective=False) is exported like any prediction. A
layer kind without an exporter is refused by name.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from ...errors import GraphError
from ...graph import Network
from ...precision import quantize_weight
from ...types import PathLike
from .importer import _onnx

OPSET = 18
EXPORTERS: dict = {}
LENGTHS = "lengths"  # the extra input of a model with sequence inputs


def exporter(*kinds):
    def register(fn):
        for kind in kinds:
            EXPORTERS[kind] = fn
        return fn
    return register


class Graph:
    """The ONNX graph being written: nodes, initializers, fresh names."""

    def __init__(self, onnx, precision="float32"):
        self.onnx, self.helper = onnx, onnx.helper
        self.nodes, self.initializers, self._names = [], [], set()
        self.opset = OPSET  # raised by nodes of operators that came later
        self.precision = precision  # the network's (lamina.precision): int8 weights are written as such

    def fresh(self, base):
        name, i = base, 0
        while name in self._names:
            i += 1
            name = f"{base}_{i}"
        self._names.add(name)
        return name

    def constant(self, base, values, dtype=np.float32):
        """An initializer of `values`, a scalar staying a scalar (np.ascontiguousarray would make
        it [1]: a Gather of index [i] keeps the axis a Gather of index i removes)."""
        name = self.fresh(base)
        values = np.asarray(values, dtype=dtype)
        values = np.ascontiguousarray(values) if values.ndim else values
        self.initializers.append(self.onnx.numpy_helper.from_array(values, name))
        return name

    def node(self, op, inputs, output=None, name=None, **attrs):
        output = output or self.fresh(f"{name or op}_out")
        self._names.add(output)
        self.nodes.append(self.helper.make_node(op, list(inputs), [output], name=self.fresh(name or op), **attrs))
        return output

    def node_outputs(self, op, inputs, labels, name, **attrs):
        """A node of several outputs, named after the node and each label."""
        outputs = [self.fresh(f"{name}_{label}") for label in labels]
        self.nodes.append(self.helper.make_node(op, list(inputs), outputs, name=self.fresh(name), **attrs))
        return outputs

    def weight(self, base, values, transposed=False, shape=None):
        """A product weight given as [out, in] rows (the output channels first): a float
        initializer, or in an int8 network (QDQ form) its int8 values per output channel and their
        scales with a DequantizeLinear, the numbers lamina multiplies by. transposed: written as
        [in, out] (a MatMul's right operand); shape: reshaped to it after (a recurrent node's W)."""
        values = np.asarray(values, np.float32)
        if self.precision != "int8":
            out = values.T if transposed else values
            return self.constant(base, out if shape is None else out.reshape(shape))
        q, scales = quantize_weight(values)
        self.opset = max(self.opset, 13)  # DequantizeLinear's axis came with opset 13
        y = self.node("DequantizeLinear", [self.constant(f"{base}_quantized", q.T if transposed else q, np.int8),
                                           self.constant(f"{base}_scale", scales)],
                      name=f"{base}_dequantize", axis=1 if transposed else 0)
        if shape is not None:
            y = self.node("Reshape", [y, self.constant(f"{base}_shape", shape, np.int64)], name=f"{base}_reshape")
        return y


def save(net: Network, path: Optional[PathLike] = None, outputs: Optional[Sequence[str]] = None) -> Any:
    """Write `net` as ONNX to `path` (atomically) and return the ModelProto; the model passes
    onnx.checker's full check. `outputs` names the outputs to export (default: every output
    inference computes); the model's inputs are what those need (ONNX Runtime asks for every
    graph input whichever outputs a run wants)."""
    onnx = _onnx()
    net.validate()
    model = to_model(net, onnx, outputs)
    onnx.checker.check_model(model, full_check=True)
    if path is not None:
        from ..model import write_atomic
        write_atomic(path, model.SerializeToString())
    return model


def inference_outputs(net, wanted=None):
    """The outputs that a run computes without any cost layer (what inference serves), of those
    `wanted` (default: all)."""
    sched = net.scheduler
    keep = {}
    for name in wanted if wanted is not None else net.output_values:
        if name not in net.output_values:
            raise GraphError(f"no output '{name}' to export; the network's outputs are "
                             f"{', '.join(repr(o) for o in net.output_values)}")
        plan = sched.plan(False, (name,))
        if any(n.layer.is_cost for n in plan.nodes):
            if wanted is not None:
                raise GraphError(f"output '{name}' is a training cost (or needs one); ONNX export takes inference outputs")
            continue
        keep[name] = (net.output_values[name], plan)
    return keep


def to_model(net, onnx, wanted=None):
    helper, tp = onnx.helper, onnx.TensorProto
    g = Graph(onnx, net.precision)
    outputs = inference_outputs(net, wanted)
    if not outputs:
        raise GraphError("nothing to export: every output of the network is a cost (training only)")
    needed = {n.name for _, plan in outputs.values() for n in plan.nodes}
    inputs = [v for v in net.input_names if any(v in plan.inputs for _, plan in outputs.values())]
    names = {}
    graph_inputs = []
    lead = lambda spec: ["batch", "time"] if spec.sequence else ["batch"]
    if any(net.values[v].spec.sequence for v in inputs):
        graph_inputs.append(helper.make_tensor_value_info(LENGTHS, tp.INT64, ["batch"]))
        g.lengths = g.node("Cast", [LENGTHS], name="lengths_int32", to=tp.INT32)
    for v in inputs:
        spec = net.values[v].spec
        if spec.kind == "selection":
            raise GraphError(f"input '{v}': selection inputs have no ONNX export yet")
        elem = tp.FLOAT if spec.kind == "float" else tp.INT64
        graph_inputs.append(helper.make_tensor_value_info(v, elem, lead(spec) + list(spec.shape)))
        names[v] = g.fresh(v)
        if spec.kind != "float":  # lamina's ids are int32; ONNX models take int64 ids
            names[v] = g.node("Cast", [v], name=f"{v}_int32", to=tp.INT32)
    missing = sorted({type(n.layer).__name__ for n in net.scheduler.order
                      if n.name in needed and n.layer.kind not in EXPORTERS})
    if missing:
        raise GraphError(f"no ONNX export yet for layer type{'s' if len(missing) > 1 else ''} {', '.join(missing)}")
    for node in net.scheduler.order:
        if node.name not in needed:
            continue
        ins = [names[v.name] for v in node.inputs]
        outs = EXPORTERS[node.layer.kind](g, node.layer, ins, [net.values[v.name].spec for v in node.inputs], node)
        for out, onnx_name in zip(node.outputs, outs if isinstance(outs, (list, tuple)) else [outs]):
            names[out] = onnx_name
    graph_outputs = []
    for name, (value, _) in outputs.items():
        g.node("Identity", [names[value]], output=name, name=f"output_{name}")
        spec = net.values[value].spec
        elem = tp.FLOAT if spec.kind == "float" else tp.INT32  # (lamina's integer values are int32)
        graph_outputs.append(helper.make_tensor_value_info(name, elem, lead(spec) + list(spec.shape)))
    graph = helper.make_graph(g.nodes, "lamina", graph_inputs, graph_outputs, initializer=g.initializers)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", g.opset)], producer_name="lamina")


def param(layer, name):
    return np.asarray(layer.params[name].value, np.float32)


ACTIVATION_OPS = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exponential": "Exp", "softrelu": "Softplus",
                  "selu": "Selu", "softsign": "Softsign", "hard_swish": "HardSwish", "sqrt": "Sqrt",
                  "reciprocal": "Reciprocal", "log": "Log", "abs": "Abs", "erf": "Erf"}


def activate(g, x, kind, slope, name):
    if kind == "linear":
        return x
    if kind == "leaky_relu":
        return g.node("LeakyRelu", [x], name=f"{name}_act", alpha=float(slope))
    if kind in ("softmax", "log_softmax"):
        return g.node("Softmax" if kind == "softmax" else "LogSoftmax", [x], name=f"{name}_act", axis=-1)
    if kind == "elu":
        return g.node("Elu", [x], name=f"{name}_act", alpha=float(slope))
    if kind == "hard_sigmoid":
        return g.node("HardSigmoid", [x], name=f"{name}_act", alpha=float(slope), beta=0.5)
    if kind == "bounded_relu":
        bounds = [g.constant(f"{name}_{end}", bound) for end, bound in (("min", 0.0), ("max", slope))]
        return g.node("Clip", [x] + bounds, name=f"{name}_act")
    if kind in ("gelu", "gelu_tanh"):
        g.opset = max(g.opset, 20)  # ONNX's Gelu came with opset 20
        return g.node("Gelu", [x], name=f"{name}_act", approximate="tanh" if kind == "gelu_tanh" else "none")
    return g.node(ACTIVATION_OPS[kind], [x], name=f"{name}_act")


@exporter("linear", "selective_linear")
def linear(g, layer, ins, specs, node):
    """One input of [batch, in]: one Gemm (bias included). Several inputs, or a sequence batch
    [batch, time, in] (MatMul broadcasts over both leading axes): a MatMul per input, summed,
    plus the bias. A selective layer exports where it runs as its full layer (no selection
    input: every column, as the language model's inference scores the whole vocabulary); its
    selected form is a training device (sampled softmax), and a selection input is refused."""
    bias = [g.constant(f"{node.name}.bias", param(layer, "bias"))] if layer.has_bias else []
    if len(ins) == 1 and not specs[0].sequence:
        w = g.weight(f"{node.name}.{layer.weight_names[0]}", param(layer, layer.weight_names[0]))
        y = g.node("Gemm", [ins[0], w] + bias, name=node.name, transB=1)
    else:
        y = None
        for x, wname in zip(ins, layer.weight_names):
            t = g.node("MatMul", [x, g.weight(f"{node.name}.{wname}_t", param(layer, wname), transposed=True)],
                       name=node.name)
            y = t if y is None else g.node("Add", [y, t], name=f"{node.name}_sum")
        if bias:
            y = g.node("Add", [y] + bias, name=f"{node.name}_bias")
    return activate(g, y, layer.activation, layer.slope, node.name)


@exporter("activation")
def activation(g, layer, ins, specs, node):
    return activate(g, ins[0], layer.activation, layer.slope, node.name) if layer.activation != "linear" \
        else g.node("Identity", ins, name=node.name)


@exporter("prelu")
def prelu(g, layer, ins, specs, node):
    rest = len(specs[0].shape) - 1  # the slope broadcasts over a channel's other axes
    slopes = param(layer, "weight").reshape((-1,) + (1,) * rest if layer.num_parameters > 1 else (1,))
    return g.node("PRelu", [ins[0], g.constant(f"{node.name}.weight", slopes)], name=node.name)


@exporter("add")
def add(g, layer, ins, specs, node):
    y = ins[0] if len(ins) > 1 else g.node("Identity", ins, name=node.name)
    for x in ins[1:]:
        y = g.node("Add", [y, x], name=node.name)
    return activate(g, y, layer.activation, layer.slope, node.name)


@exporter("scale")
def scale(g, layer, ins, specs, node):
    return g.node("Mul", [ins[0], g.constant(f"{node.name}.factor", np.float32(layer.factor))], name=node.name)


@exporter("bias")
def bias(g, layer, ins, specs, node):
    return g.node("Add", [ins[0], g.constant(f"{node.name}.bias", param(layer, "bias"))], name=node.name)


@exporter("dropout")
def dropout(g, layer, ins, specs, node):
    return g.node("Identity", ins, name=node.name)


def sample_axis(spec):
    """The ONNX axis of a sample's first axis: after the batch (and time) axes."""
    return 2 if spec.sequence else 1


@exporter("concat", "concat_channels")
def concat(g, layer, ins, specs, node):
    return g.node("Concat", ins, name=node.name, axis=sample_axis(specs[0]))


@exporter("reshape")
def reshape(g, layer, ins, specs, node):
    # 0 keeps the batch (and time) size as it is
    shape = g.constant(f"{node.name}.shape", [0] * sample_axis(specs[0]) + list(layer.shape), dtype=np.int64)
    return g.node("Reshape", [ins[0], shape], name=node.name)


@exporter("broadcast")
def broadcast(g, layer, ins, specs, node):
    # ONNX's Expand broadcasts both ways: ones keep the batch (and time) axes as they are
    shape = g.constant(f"{node.name}.shape", [1] * sample_axis(specs[0]) + list(layer.shape), dtype=np.int64)
    return g.node("Expand", [ins[0], shape], name=node.name)


@exporter("transpose")
def transpose(g, layer, ins, specs, node):
    lead = sample_axis(specs[0])
    return g.node("Transpose", ins, name=node.name, perm=list(range(lead)) + [p + lead for p in layer.perm])


@exporter("slice")
def slice_(g, layer, ins, specs, node):
    axis = sample_axis(specs[0])
    if layer.squeeze and len(specs[0].shape) > 1:
        return g.node("Gather", [ins[0], g.constant(f"{node.name}.index", np.int64(layer.start), dtype=np.int64)],
                      name=node.name, axis=axis)
    bounds = [g.constant(f"{node.name}.{what}", [v], dtype=np.int64)
              for what, v in (("start", layer.start), ("stop", layer.stop), ("axis", axis))]
    return g.node("Slice", [ins[0], *bounds], name=node.name)


@exporter("embedding")
def embedding(g, layer, ins, specs, node):
    return g.node("Gather", [g.constant(f"{node.name}.weight", param(layer, "weight")), ins[0]], name=node.name, axis=0)


@exporter("softmax_cross_entropy")
def softmax_cross_entropy(g, layer, ins, specs, node):
    x = ins[0]
    if specs[0].sequence:  # [batch, time, classes]: ONNX's loss takes the classes on axis 1
        x = g.node("Transpose", [x], name=f"{node.name}_classes_first", perm=[0, 2, 1])
    cost = g.node("SoftmaxCrossEntropyLoss", [x, ins[1]], name=node.name, reduction="none")
    return cost if len(ins) == 2 else g.node("Mul", [cost, ins[2]], name=f"{node.name}_weighted")


@exporter("conv3d", "conv2d", "conv_transpose3d", "conv_transpose2d")
def conv(g, layer, ins, specs, node):
    nd = len(layer.kernel_size)
    attrs = dict(kernel_shape=list(layer.kernel_size), strides=list(layer.stride), dilations=list(layer.dilation),
                 pads=list(layer.padding) + list(layer.padding_end), group=layer.groups)
    if layer.transposed:
        attrs["output_padding"] = list(layer.output_padding)
    args = [ins[0], g.constant(f"{node.name}.weight", param(layer, "weight"))]
    if layer.has_bias:
        args.append(g.constant(f"{node.name}.bias", param(layer, "bias")))
    assert nd == len(specs[0].shape) - 1
    return g.node("ConvTranspose" if layer.transposed else "Conv", args, name=node.name, **attrs)


@exporter("max_pool3d", "max_pool2d", "avg_pool3d", "avg_pool2d")
def pool(g, layer, ins, specs, node):
    attrs = dict(kernel_shape=list(layer.kernel_size), strides=list(layer.stride),
                 pads=list(layer.padding) + list(layer.padding_end), ceil_mode=int(layer.ceil_mode))
    if max(layer.dilation) > 1:
        attrs["dilations"] = list(layer.dilation)
        if layer.kind.startswith("avg"):
            g.opset = max(g.opset, 19)  # AveragePool's dilations came with opset 19
    if layer.kind.startswith("avg"):
        return g.node("AveragePool", ins, name=node.name, count_include_pad=int(layer.count_include_pad), **attrs)
    if not layer.return_indices:
        return g.node("MaxPool", ins, name=node.name, **attrs)
    # ONNX's Indices count over the whole tensor: each plane's first position (a pool of kernel 1's
    # Indices at the plane's origin) is subtracted, as PyTorch's exporters write it; int32 as lamina's
    y, flat = g.node_outputs("MaxPool", ins, ("out", "flat_indices"), node.name, **attrs)
    nd = len(layer.kernel_size)
    _, every = g.node_outputs("MaxPool", ins, ("identity", "every_position"), f"{node.name}_plane_starts",
                              kernel_shape=[1] * nd, strides=[1] * nd)
    origin = [g.constant(f"{node.name}_{what}", values, np.int64)
              for what, values in (("origin", [0] * nd), ("origin_end", [1] * nd), ("spatial", range(2, 2 + nd)))]
    starts = g.node("Slice", [every, *origin], name=f"{node.name}_plane_start")
    plane = g.node("Sub", [flat, starts], name=f"{node.name}_plane_indices")
    return [y, g.node("Cast", [plane], name=f"{node.name}_indices", to=g.onnx.TensorProto.INT32)]


@exporter("pad")
def pad(g, layer, ins, specs, node):
    """ONNX's Pad: no padding of the batch (and time) axes, the layer's pairs after them."""
    lead = [(0, 0)] * sample_axis(specs[0])
    pairs = lead + list(layer.pads)
    pads = [b for b, _ in pairs] + [a for _, a in pairs]
    return g.node("Pad", [ins[0], g.constant(f"{node.name}.pads", pads, dtype=np.int64)], name=node.name,
                  mode=layer.mode)


@exporter("reduce")
def reduce(g, layer, ins, specs, node):
    axes = [a + sample_axis(specs[0]) for a in layer.axes]
    return g.node("ReduceMean" if layer.mode == "mean" else "ReduceSum",
                  [ins[0], g.constant(f"{node.name}.axes", axes, dtype=np.int64)], name=node.name, keepdims=1)


@exporter("resize")
def resize(g, layer, ins, specs, node):
    """ONNX's Resize: the layer's scales where it has them, else its sizes for the spatial axes
    (opset 18's axes), with its coordinate mode and rounding."""
    spatial = list(range(2, len(specs[0].shape) + 1))
    rounding = {"nearest_mode": layer.rounding} if layer.mode == "nearest" else {}
    if layer.scales is not None:  # (roi and the absent one of scales and sizes are empty names)
        inputs, axes = [ins[0], "", g.constant(f"{node.name}.scales", [1.0, 1.0] + list(layer.scales))], {}
    else:
        inputs = [ins[0], "", "", g.constant(f"{node.name}.sizes", list(layer.size), dtype=np.int64)]
        axes = {"axes": spatial}
    return g.node("Resize", inputs, name=node.name, mode=layer.mode,
                  coordinate_transformation_mode=layer.coordinates, **rounding, **axes)


@exporter("batch_norm3d", "batch_norm2d")
def batch_norm(g, layer, ins, specs, node):
    c = layer.num_features
    weight = param(layer, "weight") if layer.affine else np.ones(c, np.float32)
    bias = param(layer, "bias") if layer.affine else np.zeros(c, np.float32)
    args = [ins[0]] + [g.constant(f"{node.name}.{n}", v) for n, v in (
        ("weight", weight), ("bias", bias), ("running_mean", param(layer, "running_mean")),
        ("running_var", param(layer, "running_var")))]
    return g.node("BatchNormalization", args, name=node.name, epsilon=float(layer.eps))


@exporter("layer_norm", "rms_norm")
def layer_norm(g, layer, ins, specs, node):
    """ONNX's LayerNormalization (opset 17) or RMSNormalization (opset 23) over the trailing
    normalized_shape axes."""
    shape = layer.normalized_shape
    args = [ins[0], g.constant(f"{node.name}.weight",
                               param(layer, "weight") if layer.elementwise_affine else np.ones(shape, np.float32))]
    if layer.has_bias:
        args.append(g.constant(f"{node.name}.bias", param(layer, "bias")))
    rms = layer.kind == "rms_norm"
    if rms:
        g.opset = max(g.opset, 23)  # ONNX's RMSNormalization came with opset 23
    eps = layer.eps if layer.eps is not None else float(np.finfo(np.float32).eps)
    return g.node("RMSNormalization" if rms else "LayerNormalization", args, name=node.name, axis=-len(shape),
                  epsilon=float(eps))


def _positions(g, x, name):
    """0, 1, .., T-1 (int64) for the time axis (axis 1) of x."""
    t = g.node("Gather", [g.node("Shape", [x], name=f"{name}_shape"), g.constant(f"{name}.time_axis", 1, np.int64)],
               name=f"{name}_length", axis=0)
    return g.node("Range", [g.constant(f"{name}.zero", 0, np.int64), t, g.constant(f"{name}.one", 1, np.int64)],
                  name=f"{name}_positions")


@exporter("positional_embedding")
def positional_embedding(g, layer, ins, specs, node):
    """x + W[0 .. T-1] on the padded [batch, time, dim] (or per-sample [T, dim]) layout."""
    rows = g.node("Gather", [g.constant(f"{node.name}.weight", param(layer, "weight")),
                             _positions(g, ins[0], node.name)], name=f"{node.name}_rows", axis=0)
    return g.node("Add", [ins[0], rows], name=node.name)


@exporter("multihead_attention")
def multihead_attention(g, layer, ins, specs, node):
    """On [batch, time, E]: one MatMul to the queries, keys and values, heads split by Reshape
    and Transpose, scores scaled, masked (padding past each sequence's length, and later rows
    where causal), Softmax, the weighted sum, heads merged, the output projection."""
    E, H, d, n = layer.embed_dim, layer.num_heads, layer.head_dim, node.name
    c = lambda what, v, dtype=np.int64: g.constant(f"{n}.{what}", v, dtype)  # noqa: E731
    qkv = g.node("MatMul", [ins[0], g.weight(f"{n}.in_proj_weight", param(layer, "in_proj_weight"), transposed=True)],
                 name=f"{n}_in_proj")
    if layer.has_bias:
        qkv = g.node("Add", [qkv, c("in_proj_bias", param(layer, "in_proj_bias"), np.float32)], name=f"{n}_in_bias")
    heads = g.node("Reshape", [qkv, c("heads_shape", [0, 0, 3, H, d])], name=f"{n}_split_heads")
    q, k, v = (g.node("Gather", [heads, c(f"part{i}", i)], name=f"{n}_{part}", axis=2)
               for i, part in enumerate("qkv"))  # [batch, time, H, d] each
    q = g.node("Transpose", [q], name=f"{n}_q_heads", perm=[0, 2, 1, 3])
    k = g.node("Transpose", [k], name=f"{n}_k_heads", perm=[0, 2, 3, 1])
    v = g.node("Transpose", [v], name=f"{n}_v_heads", perm=[0, 2, 1, 3])
    scores = g.node("Mul", [g.node("MatMul", [q, k], name=f"{n}_scores"), c("scale", layer._scale(), np.float32)],
                    name=f"{n}_scaled")
    positions = _positions(g, ins[0], n)
    blocked = None  # [batch or 1, 1, time or 1, time]: true where a query may not see a key
    if specs[0].sequence:
        lengths = g.node("Unsqueeze", [g.node("Cast", [g.lengths], name=f"{n}_lengths", to=7), c("lengths_axis", [1])],
                         name=f"{n}_lengths_column")
        blocked = g.node("Unsqueeze", [g.node("GreaterOrEqual", [g.node("Unsqueeze", [positions, c("key_axis", [0])],
                                                                        name=f"{n}_key_row"), lengths],
                                              name=f"{n}_padding"), c("mask_axes", [1, 2])], name=f"{n}_padding_mask")
    if layer.causal:
        later = g.node("Greater", [g.node("Unsqueeze", [positions, c("query_axis", [0])], name=f"{n}_keys"),
                                   g.node("Unsqueeze", [positions, c("key_axis_c", [1])], name=f"{n}_queries")],
                       name=f"{n}_later")
        blocked = later if blocked is None else g.node("Or", [blocked, later], name=f"{n}_blocked")
    if blocked is not None:
        scores = g.node("Where", [blocked, c("blocked", -np.inf, np.float32), scores], name=f"{n}_masked")
    attended = g.node("MatMul", [g.node("Softmax", [scores], name=f"{n}_softmax", axis=-1), v], name=f"{n}_attend")
    merged = g.node("Reshape", [g.node("Transpose", [attended], name=f"{n}_merge", perm=[0, 2, 1, 3]),
                                c("merged_shape", [0, 0, E])], name=f"{n}_merged")
    out = g.node("MatMul", [merged, g.weight(f"{n}.out_proj.weight", param(layer, "out_proj.weight"), transposed=True)],
                 name=f"{n}_out_proj")
    if layer.has_bias:
        out = g.node("Add", [out, c("out_proj_bias", param(layer, "out_proj.bias"), np.float32)], name=n)
    return out


@exporter("sequence_pool")
def sequence_pool(g, layer, ins, specs, node):
    """One row per sequence of the padded [batch, time, ...] input, reading only the steps within
    each sequence's length."""
    n, x, rank = node.name, ins[0], 2 + len(specs[0].shape)
    c = lambda what, v, dtype=np.int64: g.constant(f"{n}.{what}", v, dtype)  # noqa: E731
    if layer.mode == "first":
        return g.node("Gather", [x, c("first", 0)], name=n, axis=1)
    lengths = g.node("Cast", [g.lengths], name=f"{n}_lengths", to=7)
    column = g.node("Reshape", [lengths, c("column", [-1] + [1] * (rank - 1))], name=f"{n}_lengths_column")
    if layer.mode == "last":  # x[i, lengths[i] - 1]
        index = g.node("Sub", [column, c("one", 1)], name=f"{n}_last_step")
        one_step = g.node("Concat", [g.node("Slice", [g.node("Shape", [x], name=f"{n}_shape"), c("s0", [0]), c("s1", [1])],
                                            name=f"{n}_batch"), c("step", [1]),
                                     g.node("Slice", [g.node("Shape", [x], name=f"{n}_shape2"), c("s2", [2]),
                                                      c("end", [rank])], name=f"{n}_features")],
                          name=f"{n}_index_shape", axis=0)
        index = g.node("Expand", [index, one_step], name=f"{n}_index")
        return g.node("Squeeze", [g.node("GatherElements", [x, index], name=f"{n}_gather", axis=1), c("axis", [1])],
                      name=n)
    positions = _positions(g, x, n)
    inside = g.node("Less", [g.node("Reshape", [positions, c("row", [1, -1] + [1] * (rank - 2))], name=f"{n}_steps"),
                             column], name=f"{n}_inside")
    if layer.mode == "max":
        kept = g.node("Where", [inside, x, c("lowest", -np.inf, np.float32)], name=f"{n}_kept")
        return g.node("ReduceMax", [kept, c("axes", [1])], name=n, keepdims=0)
    total = g.node("ReduceSum", [g.node("Mul", [x, g.node("Cast", [inside], name=f"{n}_weights", to=1)],
                                        name=f"{n}_masked"), c("axes", [1])], name=f"{n}_sum", keepdims=0)
    if layer.mode == "sum":
        return total
    count = g.node("Reshape", [g.node("Cast", [lengths], name=f"{n}_count", to=1), c("count_shape", [-1] + [1] * (rank - 2))],
                   name=f"{n}_count_column")
    return g.node("Div", [total, count], name=n)


@exporter("multiply")
def multiply(g, layer, ins, specs, node):
    return g.node("Mul", ins, name=node.name)


COMPARE_OPS = {"greater": "Greater", "less": "Less", "greater_equal": "GreaterOrEqual", "less_equal": "LessOrEqual",
               "equal": "Equal"}


@exporter("compare")
def compare(g, layer, ins, specs, node):
    """The test against 0, cast to float (lamina's masks are 0 and 1)."""
    n = node.name
    test = g.node(COMPARE_OPS[layer.op], [ins[0], g.constant(f"{n}.zero", 0.0)], name=f"{n}_test")
    return g.node("Cast", [test], name=n, to=g.onnx.TensorProto.FLOAT)


@exporter("where")
def where(g, layer, ins, specs, node):
    """Where(cond > 0, a, b), a fixed operand as an initializer of one sample's shape (it
    broadcasts over the batch)."""
    n, given = node.name, iter(ins)
    operands = [g.constant(f"{n}.{k}", param(layer, k).reshape(layer.shape)) if k in layer.fixed else next(given)
                for k in layer.OPERANDS]
    cond = g.node("Greater", [operands[0], g.constant(f"{n}.zero", 0.0)], name=f"{n}_cond")
    return g.node("Where", [cond] + operands[1:], name=n)


# lamina's (PyTorch's) gate blocks in ONNX's order: LSTM i,o,f,c from i,f,g,o; GRU z,r,h from r,z,n
ONNX_FROM_LAMINA = {"lstm": (0, 3, 1, 2), "gru": (1, 0, 2), "rnn": (0,)}


def _onnx_gates(a, kind):
    parts = np.split(a, len(ONNX_FROM_LAMINA[kind]))
    return np.concatenate([parts[g] for g in ONNX_FROM_LAMINA[kind]])


@exporter("rnn", "lstm", "gru")
def recurrent(g, layer, ins, specs, node):
    """Per layer: Transpose to time-major, the ONNX node with sequence_lens (and this layer's
    slice of the initial states, when they are inputs), back to [batch, time, D·H]; the last
    states (and cells) of every layer concatenated as lamina's [batch, L·D, H]."""
    op = {"rnn": "RNN", "lstm": "LSTM", "gru": "GRU"}[layer.kind]
    D, H = layer.directions, layer.hidden_size
    direction = "bidirectional" if D == 2 else ("reverse" if layer.reverse else "forward")
    attrs = dict(hidden_size=H, direction=direction)
    if layer.kind == "gru":
        attrs["linear_before_reset"] = int(layer.linear_before_reset)
    if layer.kind == "rnn" and layer.nonlinearity == "relu":
        attrs["activations"] = ["Relu"] * D
    if layer.kind == "lstm" and layer.clip is not None:
        attrs["clip"] = layer.clip
    x, lasts, cells = ins[0], [], []
    for l in range(layer.num_layers):
        sfx = [layer._suffix(l, d) for d in range(D)]
        w = np.stack([_onnx_gates(param(layer, "weight_ih" + s), layer.kind) for s in sfx])
        r = np.stack([_onnx_gates(param(layer, "weight_hh" + s), layer.kind) for s in sfx])
        if layer.has_bias:
            b = np.stack([np.concatenate([_onnx_gates(param(layer, "bias_ih" + s), layer.kind),
                                          _onnx_gates(param(layer, "bias_hh" + s), layer.kind)]) for s in sfx])
        else:
            b = np.zeros((D, 2 * w.shape[1]), np.float32)
        xt = g.node("Transpose", [x], name=f"{node.name}_l{l}_time_major", perm=[1, 0, 2])
        args = [xt] + [g.weight(f"{node.name}.{n}_l{l}", v.reshape(-1, v.shape[-1]), shape=v.shape)
                       for n, v in (("W", w), ("R", r))] + [g.constant(f"{node.name}.B_l{l}", b)]
        args.append(g.lengths)
        for state in ins[1:]:  # lamina's [batch, L·D, H] → this layer's [D, batch, H]
            bounds = [g.constant(f"{node.name}_l{l}_{what}", [v], dtype=np.int64)
                      for what, v in (("first", l * D), ("end", (l + 1) * D), ("axis", 1))]
            mine = g.node("Slice", [state, *bounds], name=f"{node.name}_l{l}_initial")
            args.append(g.node("Transpose", [mine], name=f"{node.name}_l{l}_initial_state_major", perm=[1, 0, 2]))
        if layer.kind == "lstm" and layer.peepholes:  # P [D, 3H], ONNX's order i, o, f (lamina's rows i, f, o)
            peep = np.stack([param(layer, "weight_peephole" + s)[[0, 2, 1]].reshape(-1) for s in sfx])
            args += [""] * (7 - len(args)) + [g.constant(f"{node.name}.P_l{l}", peep)]
        outs = [g.fresh(f"{node.name}_l{l}_{o}") for o in (("Y", "Y_h", "Y_c") if op == "LSTM" else ("Y", "Y_h"))]
        g.nodes.append(g.helper.make_node(op, args, outs, name=g.fresh(f"{node.name}_l{l}"), **attrs))
        y = g.node("Transpose", [outs[0]], name=f"{node.name}_l{l}_batch_major", perm=[2, 0, 1, 3])
        x = g.node("Reshape", [y, g.constant(f"{node.name}_l{l}_shape", [0, 0, -1], dtype=np.int64)],
                   name=f"{node.name}_l{l}_join")
        lasts.append(outs[1])
        if op == "LSTM":
            cells.append(outs[2])
    results = [x]
    for states in (lasts, cells) if op == "LSTM" else (lasts,):
        joined = states[0] if len(states) == 1 else g.node("Concat", states, name=f"{node.name}_states", axis=0)
        results.append(g.node("Transpose", [joined], name=f"{node.name}_states_batch_major", perm=[1, 0, 2]))
    return results
