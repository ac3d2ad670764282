"""ONNX → lamina Network.

The first axis of every graph input is the batch (lamina's implied row axis). An input whose
later axes are dynamic is imported at given sizes, and again at each new size a batch brings
(`load`; lamina.sample_shapes), so within one import every size is known. Every tensor of the graph is then either a constant (an initializer, a Constant,
or anything computed only from constants: folded here with onnx's reference evaluator) or a
lamina value whose ONNX shape is (batch,) + its per-sample shape. Each operator on values maps
onto lamina layers (the converters of `operators/`, one module per operator family, found
through `registry`); initializers they use become the layers' Parameters, so an imported
model trains like a native one.

A model is read whole before anything is refused: every (node, operator, attribute) lamina cannot
run is collected, and one UnsupportedModelError lists them all. A file that is not ONNX, or fails
onnx.checker, is a ModelFileError naming the file.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ... import layers as L
from ...graph import Network, Value
from ...errors import ModelFileError, UnsupportedModelError
from . import attention, fusions, operators, positions, quantized, registry, shapes  # noqa: F401  (operators: registers the converters)
from .operators import pool_indices, sorting
from .registry import Refused, default_axes


FOLD_BUDGET = 1 << 30  # bytes all of a model's folded constants may take


@dataclass
class Unknown:
    """The output of a refused node: later nodes are still checked, never built."""
    reason: str = ""


def _onnx():
    from ...extras import require
    onnx = require("onnx", "onnx")
    require("onnx.numpy_helper", "onnx")
    require("onnx.reference", "onnx")
    return onnx


def _read(source):
    """(ModelProto, where) from a path, bytes, or a ModelProto."""
    onnx = _onnx()
    if isinstance(source, onnx.ModelProto):
        return source, "the ONNX model"
    if isinstance(source, (bytes, bytearray)):
        where, blob = "the ONNX model (bytes)", bytes(source)
    else:
        where = os.fspath(source)
        try:
            with open(where, "rb") as f:
                blob = f.read()
        except OSError as e:
            raise ModelFileError(f"{where}: cannot read the ONNX file ({e.strerror})") from None
    try:
        model = onnx.load_model_from_string(blob)
    except Exception as e:  # protobuf's DecodeError and friends
        raise ModelFileError(f"{where}: not an ONNX model ({type(e).__name__}: {e})") from None
    _load_external_data(model, where, None if isinstance(source, (bytes, bytearray)) else os.path.dirname(where))
    return model, where


def _load_external_data(model, where, folder):
    """Read the tensors the model keeps in files beside it, resolved against the model file's own
    folder (as ONNX does), never the working directory; onnx refuses locations that leave that
    folder, links, and offsets or lengths past a file's end. `folder` None: the model came as
    bytes, and a tensor kept outside it is refused."""
    from onnx.external_data_helper import _get_all_tensors, load_external_data_for_tensor, uses_external_data
    for tensor in _get_all_tensors(model):
        if not uses_external_data(tensor):
            continue
        location = next((e.value for e in tensor.external_data if e.key == "location"), "?")
        if folder is None:
            raise ModelFileError(f"{where}: tensor '{tensor.name}' is kept in the external file '{location}'; load "
                                 f"the model from its path, so the file is found beside it")
        try:
            load_external_data_for_tensor(tensor, folder or ".")
        except Exception as e:  # onnx raises ValueError, OSError and its checker's ValidationError
            raise ModelFileError(f"{where}: tensor '{tensor.name}' in external file '{location}' (beside the model) "
                                 f"cannot be read: {e}") from None


def load(source: Any, dtype: Any = "float32", sequences: Optional[Mapping[str, str]] = None,
         constants: Optional[Mapping[str, Any]] = None,
         shapes: Optional[Mapping[str, Sequence[int]]] = None) -> Network:
    """A Network from an ONNX model: a path, the file's bytes, or an onnx.ModelProto.

    `constants` gives inputs a value fixed at import ({"sr": 16000}: a sample rate, a flag):
    they are no inputs of the network, what is computed from them folds, and an `If` whose
    condition folds runs its branch.

    `sequences` names the inputs that are padded sequence batches and the order of their first
    two axes: {"X": "TN"} (time-major) or "NT" (batch-major); an input whose first two axes are
    both dynamic is taken as "NT". Such an input becomes a lamina sequence input (fed a
    lamina.Sequences: no padding). `net.onnx_axes[name]` gives, for every input and output, the
    ONNX axes in order: "N" (batch), "T" (time) or k (axis k of lamina's per-sample or per-step
    shape); `to_onnx_layout` turns an output into that layout.

    An input with dynamic axes after the batch (an image `[N, 3, H, W]`) takes any size there:
    each batch runs on the model imported at its sample shapes (`Network.dynamic_axes`, kept
    for the most recent few shapes, every one training the same parameters). The network is
    first imported at `shapes` ({"image": (3, 480, 640)}: sample shapes without the batch
    axis), or where not given at 224 per dynamic axis (64 for three or more)."""
    onnx = _onnx()
    model, where = _read(source)
    try:
        onnx.checker.check_model(model, full_check=False)
    except Exception as e:  # onnx.checker.ValidationError and protobuf errors
        raise ModelFileError(f"{where}: the model fails onnx.checker: {e}") from None
    known = onnx.defs.onnx_opset_version()
    if opset_of(model) > known:
        raise ModelFileError(f"{where}: the model asks for ONNX opset {opset_of(model)}; the onnx package "
                             f"{onnx.__version__} knows opsets up to {known}")
    importer = Importer(_with_inferred_shapes(model), where, dtype, sequences or {}, constants or {})
    dynamic = importer.dynamic_sample_axes()
    for name in sorted(set(shapes or {}) - set(dynamic)):
        raise ModelFileError(f"{where}: shapes names '{name}', which is no input with dynamic axes after the batch "
                             f"(those: {', '.join(sorted(dynamic)) or 'none'})")
    if not dynamic:
        return importer.build()

    def at(sample_shapes):
        concrete = _at_sample_shapes(model, sample_shapes)
        return Importer(_with_inferred_shapes(concrete), where, dtype, sequences or {}, constants or {}).build()

    example = {name: _example_shape(importer, name, axes, (shapes or {}).get(name)) for name, axes in dynamic.items()}
    net = at(example)
    net.set_dynamic_axes(dynamic, at)
    return net


def _with_inferred_shapes(model):
    try:
        return _onnx().shape_inference.infer_shapes(model)
    except Exception:  # shapes are a help, not a requirement
        return model


def _example_shape(importer, name, axes, given):
    """The sample shape an input with dynamic axes is first imported at."""
    dims = importer.sample_dims(name)
    if given is None:
        size = 224 if len(axes) <= 2 else 64
        return tuple(size if d is None else d for d in dims)
    given = tuple(int(s) for s in given)
    fixed = [(i, d, g) for i, (d, g) in enumerate(zip(dims, given)) if d is not None and d != g]
    if len(given) != len(dims) or fixed or min(given, default=1) < 1:
        raise ModelFileError(f"{importer.where}: shapes['{name}'] is {list(given)}; the input's sample shape is "
                             f"{['?' if d is None else d for d in dims]} (each ? a size of at least 1)")
    return given


def _at_sample_shapes(model, sample_shapes):
    """A copy of `model` whose inputs have these sample shapes (the batch axis left as it is)."""
    onnx = _onnx()
    concrete = onnx.ModelProto()
    concrete.CopyFrom(model)
    del concrete.graph.value_info[:]  # inferred again at the new sizes
    for inp in concrete.graph.input:
        shape = sample_shapes.get(inp.name)
        if shape is None:
            continue
        dims = inp.type.tensor_type.shape.dim
        lead = len(dims) - len(shape)
        for dim, size in zip(list(dims)[lead:], shape):
            dim.Clear()
            dim.dim_value = int(size)
    return concrete


def to_onnx_layout(value: Any, axes: Sequence[Any]) -> np.ndarray:
    """A network output (array, or Sequences of equal lengths padded with zeros) as the ONNX
    tensor of the given axes."""
    from ...sequence import Sequences
    if isinstance(value, Sequences):
        array, _ = value.to_padded()  # [N, T, *step], zeros past each end (as ONNX Runtime)
        have = ("N", "T") + tuple(range(array.ndim - 2))
    else:
        array = np.asarray(value)
        have = ("N",) + tuple(range(array.ndim - 1))
    return np.transpose(array, [have.index(a) for a in axes])


def feeds(net: Network, arrays: Mapping[str, Any]) -> dict[str, Any]:
    """Feeds for an imported network from arrays as the ONNX model takes them: a sequence input
    may be a padded array in the model's layout (`net.onnx_axes`), with its lengths in the
    model's sequence_lens input (`net.onnx_lengths`) or attention mask (`net.onnx_masks`, ones
    then zeros in each row; without either, every sequence is full length);
    it becomes a lamina.Sequences. Sequences pass as they are (lengths fed beside them must
    agree); a bool array fed to a BOOL input becomes 0 and 1; other inputs pass unchanged."""
    from ...errors import InputError
    from ...sequence import SequenceError, Sequences
    arrays = dict(arrays)
    given = [(n, arrays.pop(n)) for n in getattr(net, "onnx_lengths", ()) if n in arrays]
    given += [(n, _mask_lengths(n, arrays.pop(n))) for n in getattr(net, "onnx_masks", ()) if n in arrays]
    if getattr(net, "onnx_constant_lengths", None) is not None:
        given.append(("the model's constant sequence_lens", net.onnx_constant_lengths))
    lengths = None
    for name, a in given:
        a = np.asarray(a)
        if a.ndim != 1 or a.dtype.kind not in "iu":
            raise InputError(f"input '{name}': expected one integer length per sequence, found {a.dtype} {a.shape}")
        if lengths is not None and not np.array_equal(a, lengths):
            raise InputError(f"input '{name}': these lengths differ from the other lengths input's")
        lengths = a
    out = {}
    for name, a in arrays.items():
        value = net.values.get(name)
        if isinstance(a, np.ndarray) and a.dtype == np.bool_ and value is not None and value.spec.kind == "float":
            a = a.astype(net.dtype)  # a BOOL input (a mask) as 0 and 1
        axes = getattr(net, "onnx_axes", {}).get(name)
        if value is not None and not value.spec.sequence and axes is not None and axes != default_axes(value.spec) \
                and not isinstance(a, Sequences):
            a = np.asarray(a)
            if a.ndim != len(axes):
                raise InputError(f"input '{name}': expected an array of axes {axes} (N batch), found shape {a.shape}")
            a = np.ascontiguousarray(np.transpose(a, [axes.index(k) for k in default_axes(value.spec)]))
        if value is None or not value.spec.sequence:
            out[name] = a
            continue
        if isinstance(a, Sequences):
            if lengths is not None and not np.array_equal(a.lengths, lengths):
                raise InputError(f"input '{name}': the lengths fed ({lengths.tolist()}) are not those of the "
                                 f"Sequences ({a.lengths.tolist()})")
            out[name] = a
            continue
        a = np.asarray(a)
        axes = net.onnx_axes[name]
        if a.ndim != len(axes):
            raise InputError(f"input '{name}': expected a padded array of axes {axes} (N batch, T time), "
                             f"found shape {a.shape}")
        batch_first = np.transpose(a, [axes.index(k) for k in default_axes(value.spec)])
        n = lengths if lengths is not None else _unpadded_lengths(batch_first, getattr(net, "onnx_reserved_ids", {})
                                                                  .get(name))
        try:
            out[name] = Sequences.from_padded(batch_first, n)
        except SequenceError as e:
            raise InputError(f"input '{name}': {e}") from None
    for name, reserved in getattr(net, "onnx_reserved_ids", {}).items():
        ids = out.get(name)
        found = np.isin(ids.values if isinstance(ids, Sequences) else np.asarray(ids), reserved) if ids is not None \
            else None
        if found is not None and found.any():
            raise InputError(f"input '{name}': id {', '.join(map(str, reserved))} appears inside a sequence; the model "
                             f"takes it for padding (masks it, or numbers positions past it), and lamina's sequences "
                             f"hold no padding: give each sequence without it")
    return out


def _unpadded_lengths(ids, padding):
    """Each row's length: the whole row, or, for token ids with padding ids (`net.onnx_reserved_ids`:
    the model masks or numbers positions by them), up to its last other id."""
    if padding is None or ids.ndim != 2:
        return np.full(ids.shape[0], ids.shape[1])
    real = ~np.isin(ids, padding)
    return np.where(real.any(1), ids.shape[1] - np.argmax(real[:, ::-1], axis=1), 0)


def _mask_lengths(name, mask):
    """The lengths an attention mask [N, T] gives: each row ones (nonzero) then zeros, as a padded
    batch's mask is; any other mask is an InputError (lamina packs each sequence's own rows)."""
    from ...errors import InputError
    mask = np.asarray(mask)
    if mask.ndim != 2 or mask.dtype.kind not in "biuf":
        raise InputError(f"input '{name}': expected an attention mask [N, T] of ones and zeros, found "
                         f"{mask.dtype} {mask.shape}")
    keep = mask != 0
    lengths = keep.sum(1)
    wrong = np.flatnonzero(((np.arange(mask.shape[1])[None, :] < lengths[:, None]) != keep).any(1))
    if len(wrong):
        raise InputError(f"input '{name}': row {int(wrong[0])} of the attention mask is not ones followed by zeros "
                         f"({mask[wrong[0]].tolist()}); lamina takes each sequence as its first rows, without "
                         f"padding inside it")
    return lengths


# operators that keep their input's leading axes in place (element-wise on one value, or over
# its last axis only), through which a recurrent node's X is traced back to a graph input
AXES_KEPT = frozenset({"Identity", "Cast", "Dropout", "Relu", "Tanh", "Sigmoid", "LeakyRelu", "Elu", "Selu",
                       "Gelu", "Softplus", "Softsign", "HardSigmoid", "HardSwish", "Clip", "Neg", "Abs",
                       "MatMul", "Add", "Sub", "Mul", "Div"})
RECURRENT_OPS = ("LSTM", "GRU", "RNN")


def sequence_inputs(graph):
    """{input: "NT" | "TN"} for the graph inputs a recurrent node reads as X whatever their shape
    says (a fixed [T, N, C], as PyTorch's exporters write an example input's shape): X's time
    and batch axes (layout 0: [T, N, C]; 1: [N, T, C]) traced back through transposes, an
    embedding's Gather and operators that keep the leading axes, to the input's first two axes."""
    made = {out: node for node in graph.node for out in node.output if out}
    constants = {t.name for t in graph.initializer} | {n.output[0] for n in graph.node if n.op_type == "Constant"}
    inputs = {i.name for i in graph.input if i.name not in constants}
    found = {}
    for node in graph.node:
        if node.op_type not in RECURRENT_OPS or not node.input or not node.input[0]:
            continue
        layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
        labels = {0: "T", 1: "N"} if layout == 0 else {0: "N", 1: "T"}  # X's axis -> what it is
        name = node.input[0]
        for _ in range(len(graph.node)):
            if name in inputs:
                if sorted(labels) == [0, 1]:
                    found.setdefault(name, labels[0] + labels[1])
                break
            producer = made.get(name)
            if producer is None:
                break
            if producer.op_type == "Transpose":
                perm = next((list(a.ints) for a in producer.attribute if a.name == "perm"), None)
                if perm is None or max(labels) >= len(perm):
                    break
                labels = {perm[axis]: label for axis, label in labels.items()}
                name = producer.input[0]
            elif producer.op_type == "Gather" and producer.input[0] in constants and \
                    all(a.i == 0 for a in producer.attribute if a.name == "axis"):
                name = producer.input[1]  # an embedding: the ids' axes lead
            elif producer.op_type in AXES_KEPT:
                ins = [i for i in producer.input if i and i not in constants]
                if len(ins) != 1:
                    break
                name = ins[0]
            else:
                break
    return found


def state_inputs(graph):
    """The graph inputs read only as time-major recurrent nodes' initial states ([D, N, H]:
    initial_h, initial_c), directly or through Slices of their first axis (one layer's states of
    a stack, as PyTorch writes them) and Gathers along their second (the batch put in order by
    length): their batch axis is their second."""
    readers = {}
    for node in graph.node:
        for k, name in enumerate(node.input):
            if name:
                readers.setdefault(name, []).append((node, k))

    def only_states(name, depth=0):
        uses = readers.get(name, [])
        return bool(uses) and depth < 3 and all(
            _is_state_slot(node, k) or (k == 0 and (_slices_first_axis(graph, node) or _gathers_second_axis(node))
                                        and all(only_states(o, depth + 1) for o in node.output if o))
            for node, k in uses)
    outputs = {o.name for o in graph.output}
    return {i.name for i in graph.input if len(i.type.tensor_type.shape.dim) == 3 and i.name not in outputs
            and only_states(i.name)}


def _is_state_slot(node, k):
    layout = next((a.i for a in node.attribute if a.name == "layout"), 0)
    return node.op_type in ("LSTM", "GRU", "RNN") and layout == 0 and (k == 5 or (k == 6 and node.op_type == "LSTM"))


def _gathers_second_axis(node):
    """A Gather along axis 1: PyTorch puts states in the batch's order by length this way."""
    return node.op_type == "Gather" and next((a.i for a in node.attribute if a.name == "axis"), 0) == 1


def _slices_first_axis(graph, node):
    """Whether a Slice's axes input is the constant [0] (a Constant node or an initializer)."""
    if node.op_type != "Slice" or len(node.input) < 4 or not node.input[3]:
        return False
    from onnx import numpy_helper
    for init in graph.initializer:
        if init.name == node.input[3]:
            return numpy_helper.to_array(init).tolist() == [0]
    for n in graph.node:
        if n.op_type == "Constant" and n.output[0] == node.input[3]:
            value = next((a.t for a in n.attribute if a.name == "value"), None)
            return value is not None and numpy_helper.to_array(value).tolist() == [0]
    return False


def opset_of(model):
    for entry in model.opset_import:
        if entry.domain in ("", "ai.onnx"):
            return entry.version
    return 1


class Importer:
    def __init__(self, model, where, dtype, sequences, constants=None):
        self.shapes, self.quantized_ops = shapes, quantized
        self.quantized = False  # a quantized model: the network multiplies in int8 (io/onnx/quantized.py)
        self.sequences = dict(sequences)
        self.constants = dict(constants or {})
        self.onnx = _onnx()
        self.model, self.where, self.graph = model, where, model.graph
        self.opset = opset_of(model)
        self.net = Network(dtype=dtype)
        self.env = {}  # tensor name -> np.ndarray (constant) | Value | Unknown
        self.problems = []
        self.uses = {}  # tensor name -> how many nodes read it
        for node in self.graph.node:
            for name in node.input:
                if name:
                    self.uses[name] = self.uses.get(name, 0) + 1
        for out in self.graph.output:  # a graph output counts as a use
            self.uses[out.name] = self.uses.get(out.name, 0) + 1
        self.linear_of = {}  # ONNX tensor -> the bias-less Linear that produced it (MatMul + Add → bias)
        self.index = 0  # of the node being converted
        self.in_branch = False  # converting the nodes of an If's branch (not indexed by self.index)
        self.folded = 0  # bytes of the constants folded so far
        self.length_inputs = set()  # inputs read only as recurrent nodes' sequence_lens
        self.constant_lengths = None  # recurrent nodes' constant sequence_lens (operators/recurrent.py)
        self.sorted_rows = set()  # ONNX tensors whose rows are in the batch's order by length (operators/sorting.py)
        self.flat_indices = {}  # MaxPool Indices counted ONNX's way -> the pooled input (operators/pool_indices.py)
        self.static = {}  # "N" / "T" -> the batch or time size the inputs fix (static shapes), if any
        for name, order in sequence_inputs(model.graph).items():
            self.sequences.setdefault(name, order)
        self.state_inputs = state_inputs(model.graph)  # [D, N, H] initial states: their batch is axis 1
        # self-attention subgraphs, each converted whole into one layer (io/onnx/attention.py)
        graph = self.attention_graph = attention.Graph(model.graph)
        self.regions, self.absorbed, self.mask_nodes, encoded = attention.find(graph)
        for name, order in encoded.items():
            self.sequences.setdefault(name, order)
        self.mask_inputs = set()  # inputs read only as attention masks: the batch's lengths
        self.masks_read = {name for r in self.regions for name in r.mask_inputs}  # ones, read elsewhere
        # position ids computed from token ids (io/onnx/positions.py), and the ids they set apart
        self.index_subgraphs = positions.find(graph, encoded, self.absorbed)
        self.reserved_ids = {}
        # element-wise subgraphs computing one activation (io/onnx/fusions.py)
        self.fusions = fusions.find(graph, {**self.absorbed, **dict.fromkeys(self.mask_nodes),
                                            **self.index_subgraphs})

    # ------------------------------------------------------------------ building
    def build(self):
        nh = self.onnx.numpy_helper
        for init in self.graph.initializer:
            self.env[init.name] = nh.to_array(init)
        names = {i.name for i in self.graph.input}
        for name in sorted(set(self.constants) - names):
            raise ModelFileError(f"{self.where}: constants names '{name}', which is no input of the model (its inputs: "
                                 f"{', '.join(sorted(names - set(self.env)))})")
        for inp in self.graph.input:
            if inp.name in self.constants:
                self.env[inp.name] = self._constant_input(inp)
            elif inp.name not in self.env:
                self.env[inp.name] = self._input(inp)
        for node in self.graph.node:
            self._convert(node)
        outputs = {}
        for out in self.graph.output:
            v = self.env.get(out.name)
            if out.name in self.sorted_rows:
                self.problems.append((out.name, "output", "rows left in the batch's order by length (lamina keeps the "
                                                          "batch's own order)"))
            elif (problem := pool_indices.output_problem(self, out.name)) is not None:
                self.problems.append((out.name, "output", problem))
            elif isinstance(v, Value):
                outputs[out.name] = v
            elif not isinstance(v, Unknown):
                self.problems.append((out.name, "output", "a graph output that is a constant (it does not depend "
                                                          "on any input)"))
        if self.problems:
            raise UnsupportedModelError(self.where, self.problems)
        self.net.outputs(**outputs)
        self._drop_length_inputs()
        self.net.validate()
        if self.quantized:
            self.net.set_precision("int8")
        self.net.onnx_reserved_ids = {k: sorted(v) for k, v in self.reserved_ids.items() if k in self.net.values}
        self.net.onnx_axes = {name: self.axes_of(v) for name, v in
                              [(i, self.net.values[i]) for i in self.net.input_names] + list(outputs.items())}
        return self.net

    def _drop_length_inputs(self):
        """An input read only as sequence_lens, or only as an attention mask, is no input of the
        lamina network: a Sequences batch carries its lengths. `net.onnx_lengths` and
        `net.onnx_masks` name them for `feeds` (padded arrays with lengths or masks)."""
        read = {name for node in self.net.nodes for name in node.input_names}
        self.net.onnx_lengths = sorted(n for n in self.length_inputs if n not in read)
        self.net.onnx_constant_lengths = self.constant_lengths
        if self.constant_lengths is not None and self.net.onnx_lengths:
            raise UnsupportedModelError(self.where, [(self.net.onnx_lengths[0], "input", "lengths fed beside the "
                                                      "constant sequence_lens of a recurrent node")])
        self.net.onnx_masks = sorted(n for n in self.mask_inputs if n not in read and n in self.net.values)
        for name in self.net.onnx_lengths + self.net.onnx_masks:
            self.net.input_names.remove(name)
            del self.net.values[name]
        self.net._invalidate()

    @staticmethod
    def axes_of(v):
        """A value's ONNX axes (`onnx_axes`, set where they differ from default_axes)."""
        return getattr(v, "onnx_axes", None) or default_axes(v.spec)

    def _constant_input(self, inp):
        """The value `constants` gives an input, in the input's element type and shape."""
        t = inp.type.tensor_type
        dtype = self.onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        value = np.asarray(self.constants[inp.name])
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim] if t.HasField("shape") else None
        if dims is not None and (len(dims) != value.ndim or any(d is not None and d != n for d, n in zip(dims, value.shape))):
            raise ModelFileError(f"{self.where}: constants['{inp.name}'] has shape {list(value.shape)}; the input is "
                                 f"{['?' if d is None else d for d in dims]}")
        try:
            return value.astype(dtype, casting="same_kind" if value.dtype.kind == np.dtype(dtype).kind else "unsafe")
        except (TypeError, ValueError) as e:
            raise ModelFileError(f"{self.where}: constants['{inp.name}'] is not {np.dtype(dtype)} ({e})") from None

    def _order(self, name, dims):
        """The order of an input's leading axes: "NT" or "TN" for a batch of sequences, else None."""
        order = self.sequences.get(name)
        if order is None and len(dims) >= 2 and dims[0] is None and dims[1] is None:
            order = "NT"  # two dynamic leading axes: a batch of sequences
        return order

    def _graph_inputs(self):
        """The inputs that are fed (not initializers, not given as constants), with their dims."""
        initialized = {init.name for init in self.graph.initializer}
        for inp in self.graph.input:
            if inp.name not in initialized and inp.name not in self.constants and inp.type.HasField("tensor_type"):
                t = inp.type.tensor_type
                yield inp, [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim], \
                    [d.dim_param for d in t.shape.dim]

    def sample_dims(self, name):
        """An input's sizes after its batch (and time) axes, None where dynamic."""
        for inp, dims, _ in self._graph_inputs():
            if inp.name == name:
                return dims[2 if self._order(name, dims) in ("NT", "TN") else 1:]
        raise KeyError(name)

    def dynamic_sample_axes(self):
        """{input: {sample axis: its symbol}} for the inputs with dynamic axes after the batch."""
        found = {}
        for inp, dims, symbols in self._graph_inputs():
            if inp.name in self.state_inputs:
                continue  # [D, N, H]: its batch is its second axis (a dynamic D or H is refused)
            order = self._order(inp.name, dims)
            lead = 2 if order in ("NT", "TN") else 1
            if order in (None, "NT", "TN") and len(dims) > lead:
                axes = {i - lead: symbols[i] or "?" for i in range(lead, len(dims)) if dims[i] is None}
                if axes:
                    found[inp.name] = axes
        return found

    def _input(self, inp):
        t = inp.type.tensor_type
        elem = self.onnx.TensorProto.DataType.Name(t.elem_type)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if elem in ("FLOAT", "DOUBLE", "FLOAT16", "BOOL"):
            kind = "float"  # (a BOOL input is a mask: 0 and 1, fed as numbers or bools)
        elif elem in ("INT64", "INT32", "INT16", "INT8", "UINT8", "UINT16", "UINT32"):
            kind = "int32"
        else:
            self.problems.append((inp.name, "input", f"inputs of type {elem} (lamina takes float or integer tensors)"))
            return Unknown()
        if not dims:
            self.problems.append((inp.name, "input", f"a scalar input (lamina's inputs have a batch axis first; give "
                                                     f"its value at import: lm.onnx.load(..., constants="
                                                     f"{{'{inp.name}': ...}}), or lamina import --constant "
                                                     f"{inp.name}=VALUE)"))
            return Unknown()
        if elem == "BOOL":
            value = self._input_of(inp.name, dims, kind)
            if isinstance(value, Value):
                value.onnx_mask = True
            return value
        return self._input_of(inp.name, dims, kind)

    def _input_of(self, name, dims, kind):
        order = self._order(name, dims)
        if order is None and name in self.state_inputs and kind == "float":
            return self._state_input(name, dims)
        lead = 2 if order else 1
        if order not in (None, "NT", "TN"):
            self.problems.append((name, "input", f"sequences={order!r}: expected 'NT' or 'TN'"))
            return Unknown()
        if len(dims) < lead or any(d is None for d in dims[lead:]):
            self.problems.append((name, "input", f"dynamic axes after the batch{' and time' if order else ''} "
                                                     f"in shape {['?' if d is None else d for d in dims]}"))
            return Unknown()
        for label, size in zip(order or "N", dims):
            if size is not None and self.static.setdefault(label, size) != size:
                self.problems.append((name, "input", f"its {'batch' if label == 'N' else 'time'} axis has size {size}; "
                                                     f"an input before it has {self.static[label]} (lamina's inputs "
                                                     f"share the batch{' and time' if label == 'T' else ''} axis)"))
                return Unknown()
        try:
            value = self.net.input(name, tuple(dims[lead:]), dtype=kind, sequence=bool(order))
        except ValueError as e:  # an axis of size 0
            self.problems.append((name, "input", str(e)))
            return Unknown()
        if order == "TN":
            value.onnx_axes = ("T", "N") + tuple(range(len(dims) - 2))
        return value

    def _state_input(self, name, dims):
        """An initial state [D, N, H]: lamina's input of shape (D, H) per sample, under ONNX axes
        (0, N, 1) (`feeds` moves the batch axis first)."""
        if dims[0] is None or dims[2] is None:
            self.problems.append((name, "input", f"an initial state {['?' if d is None else d for d in dims]} with a "
                                                 f"dynamic axis besides the batch"))
            return Unknown()
        if dims[1] is not None and self.static.setdefault("N", dims[1]) != dims[1]:
            self.problems.append((name, "input", f"its batch axis (the second of an initial state) has size {dims[1]}; "
                                                 f"an input before it has {self.static['N']}"))
            return Unknown()
        value = self.net.input(name, (dims[0], dims[2]))
        value.onnx_axes = (0, "N", 1)
        return value

    def _convert(self, node):
        known = len(self.problems)
        self._convert_node(node)
        if not node.name:  # a node without a name is named in messages by its place and operator
            self.problems[known:] = [(n or f"#{self.index} {op}", op, why) for n, op, why in self.problems[known:]]
        self.index += 1

    def _convert_node(self, node):
        region = None if self.in_branch else self.absorbed.get(self.index)
        if region is not None or (not self.in_branch and self.index in self.mask_nodes):
            outs = [attention.Inside() for _ in node.output]
            if region is not None and region.output in node.output:
                outs[list(node.output).index(region.output)] = self._attention(region)
            for name, v in zip(node.output, outs):
                if name:
                    self.env[name] = v
            return
        fusion = None if self.in_branch else self.fusions.get(self.index)
        if fusion is not None:
            for name in node.output:
                self.env[name] = attention.Inside()
            if self.index == fusion.last:
                self._fuse(fusion)
            return
        sub = None if self.in_branch else self.index_subgraphs.get(self.index)
        if sub is not None:
            for name in node.output:
                self.env[name] = attention.Inside()
            if sub.output in node.output:
                self.env[sub.output] = self._positions(sub, node)
            return
        inputs = [(self.shapes.MaskOnes() if name in self.masks_read else self.env.get(name)) if name else None
                  for name in node.input]
        if node.op_type == "If" and node.domain in ("", "ai.onnx"):
            return self._branch(node, inputs[0])
        missing = [name for name, v in zip(node.input, inputs) if name and v is None]
        if missing:
            self.problems.append((node.name, node.op_type, f"reads '{missing[0]}', which nothing defines"))
            outs = [Unknown() for _ in node.output]
        elif all(v is None or isinstance(v, np.ndarray) for v in inputs) and node.op_type not in registry.NEVER_FOLD:
            outs = self.fold(node, inputs)
            if node.op_type == "DequantizeLinear" and inputs[0].dtype in (np.int8, np.uint8):
                self.quantized = True  # int8 weights (a QDQ model)
        elif self.quantized_ops.handles(node, inputs) and any(isinstance(v, Unknown) for v in inputs):
            outs = [Unknown() for _ in node.output]  # (behind a refused node)
        elif self.quantized_ops.handles(node, inputs):
            outs = self._attempt(node, self.quantized_ops.convert, inputs, self.attributes(node))
        elif pool_indices.handles(self, node, inputs) and not any(isinstance(v, Unknown) for v in inputs):
            outs = self._attempt(node, pool_indices.convert, inputs, self.attributes(node))
        elif sorting.handles(node, inputs) and not any(isinstance(v, Unknown) for v in inputs):
            outs = self._attempt(node, sorting.marker_op, inputs, self.attributes(node))
            for name, v in zip(node.output, outs):
                if name:
                    self.env[name] = v
            return
        elif (any(isinstance(v, (self.shapes.Symbolic, self.shapes.Zeros, self.shapes.PerPosition,
                                 self.shapes.MaskOnes, self.shapes.Lengths)) for v in inputs)
              and not any(isinstance(v, (Value, Unknown)) for v in inputs)):
            # shape arithmetic with the batch or time size
            outs = self._attempt(node, self.shapes.symbolic, inputs, self.attributes(node))
        else:
            # behind a refused node the values are unknown: the operator and its attribute names
            # are still checked, so one error lists as much as can be known
            converter = registry.CONVERTERS.get(node.op_type) if node.domain in ("", "ai.onnx") else None
            attrs = self.attributes(node)
            why = None if converter is None else registry.unsupported_attributes(node.op_type, attrs)
            if converter is None:
                self.problems.append((node.name, node.op_type, "an operator lamina has no layer for"
                                      + (f" (domain {node.domain})" if node.domain not in ("", "ai.onnx") else "")))
                outs = [Unknown() for _ in node.output]
            elif why:
                self.problems.append((node.name, node.op_type, why))
                outs = [Unknown() for _ in node.output]
            elif any(isinstance(v, Unknown) for v in inputs):
                outs = [Unknown() for _ in node.output]
            else:
                outs = self._attempt(node, converter, inputs, attrs)
        for name, v in zip(node.output, outs):
            if name:
                self.env[name] = v
        self._follow_sorted_rows(node)

    def _follow_sorted_rows(self, node):
        """A node reading values in the batch's order by length computes values in that order;
        one that mixes them with values in the original order is refused (its rows would not
        match)."""
        read = [n for n in node.input if n in self.sorted_rows]
        if not read:
            return
        others = [n for n in node.input if n and n not in self.sorted_rows and isinstance(self.env.get(n), Value)]
        if others:
            self.problems.append((node.name, node.op_type, f"mixes rows in the batch's order by length ('{read[0]}') "
                                                           f"with rows in the original order ('{others[0]}')"))
        self.sorted_rows.update(o for o in node.output if o and isinstance(self.env.get(o), Value))

    def _branch(self, node, condition):
        """An If whose condition folded to a constant: its branch's nodes converted in its place
        (they read the enclosing graph's tensors by name), the branch's outputs as the If's."""
        outs = None
        if isinstance(condition, np.ndarray) and condition.size == 1:
            attrs = self.attributes(node)
            branch = attrs.get("then_branch" if bool(condition.reshape(())) else "else_branch")
            if branch is not None:
                saved, self.in_branch = self.in_branch, True
                for k, inner in enumerate(branch.node):
                    known = len(self.problems)
                    self._convert_node(inner)
                    where = f"{node.name or 'If'} branch #{k} {inner.op_type}"
                    self.problems[known:] = [(n or where, op, why) for n, op, why in self.problems[known:]]
                self.in_branch = saved
                outs = [self.env.get(o.name, Unknown()) for o in branch.output]
        elif not isinstance(condition, Unknown):
            self.problems.append((node.name, "If", "a condition computed from the model's inputs (lamina runs one "
                                                   "graph for every sample; fix the inputs it reads with "
                                                   "lm.onnx.load(..., constants={...}))"))
        for name, v in zip(node.output, outs or [Unknown() for _ in node.output]):
            if name:
                self.env[name] = v

    def _attention(self, region):
        """The MultiheadAttention layer of an attention region, or Unknown (the refusal recorded
        against its Softmax)."""
        if isinstance(self.env.get(region.x), Unknown):
            return Unknown()
        softmax = self.graph.node[region.softmax]
        try:
            return attention.build(self, region)
        except Refused as e:
            self.problems.append((softmax.name or f"#{region.softmax} Softmax", "Softmax", f"attention: {e}"))
            return Unknown()

    def _fuse(self, fusion):
        """The longest of a fusion's candidates that computes an activation becomes that layer;
        the nodes it leaves out (all of them where none does) are converted one by one."""
        chosen = None
        for candidate in fusion.candidates:
            x = self.env.get(candidate.x)
            kind = fusions.activation_of(self, candidate) if isinstance(x, Value) and x.spec.kind == "float" else None
            if kind is not None:
                producer = self.graph.node[max(candidate.nodes)]
                y = self.add(L.Activation(kind), [x], producer)
                if getattr(x, "onnx_axes", None):
                    y.onnx_axes = x.onnx_axes
                self.env[candidate.output] = y
                chosen = candidate
                break
        resume = self.index
        for k in sorted(fusion.nodes - (chosen.nodes if chosen else frozenset())):
            del self.fusions[k]
            self.index = k
            self._convert(self.graph.node[k])
        self.index = resume

    def _positions(self, sub, node):
        """The position ids an index subgraph computes, as a constant, or Unknown (the refusal
        recorded against its last node)."""
        if isinstance(self.env.get(sub.source), Unknown):
            return Unknown()
        try:
            return positions.fold(self, sub)
        except Refused as e:
            self.problems.append((node.name or f"#{self.index} {node.op_type}", node.op_type, str(e)))
            return Unknown()

    def _attempt(self, node, convert, inputs, attrs):
        """convert(self, node, inputs, attrs), a refusal of any kind recorded against the node:
        Refused, a required attribute missing (KeyError), or what a layer or numpy raised for the
        configuration the attributes and initializers give (a stride of 0, negative pads, an axis
        out of range, a shape computed from the wrong tensor)."""
        try:
            return convert(self, node, inputs, attrs)
        except Refused as e:
            why = str(e)
        except KeyError as e:
            why = f"the required attribute {e} is missing"
        except (ValueError, TypeError, IndexError, ArithmeticError) as e:
            why = str(e) or type(e).__name__
        self.problems.append((node.name, node.op_type, why))
        return [Unknown() for _ in node.output]

    def fold(self, node, inputs):
        """Evaluate a node of constants now (onnx's reference evaluator), after onnx's shape
        inference has said how large its outputs are: a node whose outputs would pass registry.FOLD_LIMIT
        bytes (a ConstantOfShape of [20000, 20000]), or that would take the model's folded
        constants past FOLD_BUDGET, is refused before anything is allocated."""
        from .evaluator import reference_evaluator
        feeds = {name: v for name, v in zip(node.input, inputs) if name}
        size = self._folded_size(node, feeds)
        if size is not None and (size > registry.FOLD_LIMIT or self.folded + size > FOLD_BUDGET):
            what = (f"{size:,} bytes, more than the {registry.FOLD_LIMIT:,} one folded node may take"
                    if size > registry.FOLD_LIMIT else
                    f"{size:,} bytes, which would take the model's folded constants past {FOLD_BUDGET:,}")
            self.problems.append((node.name, node.op_type, f"folding this node of constants would allocate {what}"))
            return [Unknown() for _ in node.output]
        try:
            results = [np.asarray(r) for r in reference_evaluator(node, opsets={"": self.opset}).run(None, feeds)]
        except Exception as e:
            self.problems.append((node.name, node.op_type, f"could not fold this node of constants ({e})"))
            return [Unknown() for _ in node.output]
        self.folded += sum(r.nbytes for r in results)
        return results

    def _folded_size(self, node, feeds):
        """The bytes of the node's outputs by onnx's shape inference over its constant inputs, or
        None where inference cannot tell (an output's shape or type is unknown)."""
        onnx, helper = self.onnx, self.onnx.helper
        try:
            inits = [self.onnx.numpy_helper.from_array(np.asarray(v), k) for k, v in feeds.items()]
            graph = helper.make_graph([node], "fold", [], [helper.make_value_info(o, onnx.TypeProto())
                                                           for o in node.output if o], inits)
            probe = helper.make_model(graph, opset_imports=[helper.make_opsetid("", self.opset)])
            inferred = onnx.shape_inference.infer_shapes(probe, data_prop=True).graph.output
        except Exception:
            return None
        total = 0
        for info in inferred:
            t = info.type.tensor_type
            if not t.HasField("shape") or not all(d.HasField("dim_value") for d in t.shape.dim):
                return None
            itemsize = np.dtype(helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize if t.elem_type else 8
            total += math.prod(d.dim_value for d in t.shape.dim) * itemsize
        return total

    def attributes(self, node):
        helper = self.onnx.helper
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    # ------------------------------------------------------------------ helpers for converters
    def add(self, layer, inputs, node):
        """Apply a lamina layer to values, named after the ONNX node where possible."""
        name = node.name if node.name and node.name not in self.net.values else None
        return self.net.add(layer, list(inputs), name=name)
