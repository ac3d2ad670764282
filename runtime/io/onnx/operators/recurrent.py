"""ONNX's RNN, LSTM and GRU as lamina's recurrent layers (gates reordered, initial states from
inputs or zeros, lengths from an input)."""
import numpy as np

from .... import layers as L
from ....graph import Value
from .. import shapes
from . import sorting
from ..registry import Refused, assign, const, converter, onnx_shape_text, text


# ONNX's gate blocks in lamina's (PyTorch's) order: LSTM i,o,f,c -> i,f,g,o; GRU z,r,h -> r,z,n
GATE_ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}
DEFAULT_ACTIVATIONS = {"LSTM": ["Sigmoid", "Tanh", "Tanh"], "GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}


def _is_zero_or_absent(x):
    return x is None or isinstance(x, shapes.Zeros) or (isinstance(x, np.ndarray) and not np.any(x))


def _zero_or_absent(x, what, why="lamina's initial states are zero or inputs"):
    if not _is_zero_or_absent(x):
        raise Refused(f"{what} other than zero ({why})")


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


def _constant_lengths(imp, lengths):
    """Constant sequence_lens: the lengths of every batch the model runs (its batch and time sizes
    static), which `feeds` gives the Sequences it makes (`net.onnx_constant_lengths`); every
    recurrent node must read the same ones."""
    batch, steps = imp.static.get("N"), imp.static.get("T")
    if lengths.ndim != 1 or batch != len(lengths) or steps is None or lengths.dtype.kind not in "iu" \
            or lengths.min(initial=1) < 1 or lengths.max(initial=1) > steps:
        raise Refused(f"constant sequence_lens {lengths.tolist()}: expected one length from 1 to the fixed time "
                      f"size ({steps}) per sequence of the fixed batch ({batch})")
    if imp.constant_lengths is not None and not np.array_equal(imp.constant_lengths, lengths):
        raise Refused(f"constant sequence_lens {lengths.tolist()} unlike another node's "
                      f"{imp.constant_lengths.tolist()} (lamina's sequences have one length each)")
    imp.constant_lengths = lengths.astype(np.int64)


@converter("LSTM", "GRU", "RNN", attributes={"activation_alpha", "activation_beta", "activations", "clip",
                                             "direction", "hidden_size", "input_forget", "layout",
                                             "linear_before_reset"})
def recurrent(imp, node, inputs, attrs):
    op = node.op_type
    inputs = inputs + [None] * (8 - len(inputs))
    x, w, r, b, lengths, h0, c0, peep = inputs
    lengths = sorting.unsorted_lengths(lengths)
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
    clip = attrs.get("clip")
    if clip is not None and (op != "LSTM" or not clip > 0):
        raise Refused(f"clip {clip} (lamina clips an LSTM's gates, at a positive threshold)")
    if attrs.get("input_forget", 0):
        raise Refused("input_forget=1")
    if isinstance(lengths, np.ndarray):
        _constant_lengths(imp, lengths)
    elif lengths is not None:
        if not (isinstance(lengths, Value) and lengths.producer is None and lengths.spec.kind == "int32"
                and lengths.spec.shape == () and not lengths.spec.sequence):
            raise Refused("sequence_lens other than an input of one length per sequence")
        # the lengths of the Sequences lamina is fed: the input is read by lm.onnx.feeds, not the layers
        imp.length_inputs.add(lengths.name)
    peepholes = not _is_zero_or_absent(peep)
    if peepholes:
        peep = const(peep, "P")
        if peep.shape != (directions, 3 * hidden):
            raise Refused(f"P {list(peep.shape)}: expected {[directions, 3 * hidden]}")
    if w.shape[0] != directions:
        raise Refused(f"W holds {w.shape[0]} directions, direction={direction}")
    gates = len(GATE_ORDER[op])
    if w.shape != (directions, gates * hidden, x.spec.shape[0]) or r.shape != (directions, gates * hidden, hidden):
        # (checked before the layer is made: its parameters are sized by hidden_size)
        raise Refused(f"W {list(w.shape)} and R {list(r.shape)} for hidden_size {hidden}, {directions} direction(s) "
                      f"and {x.spec.shape[0]} inputs: expected W {[directions, gates * hidden, x.spec.shape[0]]} "
                      f"and R {[directions, gates * hidden, hidden]}")
    states = _initial_states(imp, [h0, c0] if op == "LSTM" else [h0], directions, hidden, layout)
    kind = {"LSTM": L.LSTM, "GRU": L.GRU, "RNN": L.RNN}[op]
    kw = {"nonlinearity": nonlinearity} if op == "RNN" else {}
    if op == "GRU":
        kw["linear_before_reset"] = bool(attrs.get("linear_before_reset", 0))
    if op == "LSTM":
        kw.update(peepholes=peepholes, clip=clip)
    layer = kind(x.spec.shape[0], hidden, bidirectional=directions == 2, reverse=direction == "reverse", **kw)
    for d in range(directions):
        sfx = layer._suffix(0, d)
        assign(layer, "weight_ih" + sfx, _reorder(w[d], op, hidden))
        assign(layer, "weight_hh" + sfx, _reorder(r[d], op, hidden))
        bias = const(b, "B")[d] if b is not None else np.zeros(2 * len(GATE_ORDER[op]) * hidden, np.float32)
        half = len(bias) // 2
        assign(layer, "bias_ih" + sfx, _reorder(bias[:half], op, hidden))
        assign(layer, "bias_hh" + sfx, _reorder(bias[half:], op, hidden))
        if peepholes:  # ONNX's rows i, o, f; lamina's i, f, o
            assign(layer, "weight_peephole" + sfx, peep[d].reshape(3, hidden)[[0, 2, 1]])
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
