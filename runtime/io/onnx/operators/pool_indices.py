"""MaxPool's Indices output.

ONNX counts each maximum's position over the whole tensor, ((n·C + c)·plane + its position in
the plane); lamina's MaxPool (return_indices) counts it within its sample's channel plane, as
PyTorch does, so that a sample's answer never depends on the batch it runs in. PyTorch's
exporters turn ONNX's positions back into PyTorch's by subtracting each plane's first position,
which they take from the Indices of a pool of kernel 1 over the same input, sliced at the
plane's origin: that pattern imports exactly, as lamina's own positions. The importer tracks
which ONNX tensors hold positions counted ONNX's way (`Importer.flat_indices`: tensor -> the
pooled input) and refuses any other use of them, and a model output of them where the two
countings can differ (anything but a static batch of one sample of one channel).
"""
import numpy as np

from ..registry import Refused, const


class EveryPosition:
    """The Indices of a MaxPool of kernel 1 over x: each element's position in the tensor."""

    def __init__(self, x):
        self.x = x


class PlaneStarts:
    """EveryPosition at each plane's origin: the position of each (sample, channel) plane's first
    element."""

    def __init__(self, x):
        self.x = x


MARKERS = (EveryPosition, PlaneStarts)


def handles(imp, node, inputs):
    """Whether `convert` takes this node: it reads a marker or positions counted ONNX's way."""
    return any(isinstance(v, MARKERS) for v in inputs) or any(n in imp.flat_indices for n in node.input if n)


def pooled(imp, node, x, y, indices, identity):
    """MaxPool's outputs with Indices: (Y, Indices); `identity` says the pool has kernel 1, stride 1
    and no padding (its Y is x, its Indices every position); else y and indices are the layer's
    outputs, indices counted in each plane."""
    if identity:
        return [x, EveryPosition(x)]
    imp.flat_indices[node.output[1]] = x
    return [y, indices]


def convert(imp, node, inputs, attrs):
    op = node.op_type
    if op == "Slice" and isinstance(inputs[0], EveryPosition):
        return [_plane_starts(inputs)]
    if op == "Sub" and node.input[0] in imp.flat_indices and isinstance(inputs[1], PlaneStarts) \
            and inputs[1].x is imp.flat_indices[node.input[0]]:
        return [inputs[0]]  # each plane's positions: lamina's own
    if op in ("Identity", "Cast") and isinstance(inputs[0], MARKERS):
        return [inputs[0]]
    raise Refused("a use of MaxPool's Indices other than PyTorch's (the Indices minus each plane's first position, "
                  "taken from a pool of kernel 1 over the same input): ONNX counts them over the whole batch, lamina "
                  "within each sample's channel plane")


def _plane_starts(inputs):
    every = inputs[0]
    nd = len(every.x.spec.shape) - 1
    starts, ends = (np.asarray(const(v, n)).tolist() for v, n in zip(inputs[1:3], ("starts", "ends")))
    axes = np.asarray(const(inputs[3], "axes")).tolist() if len(inputs) > 3 and inputs[3] is not None \
        else list(range(len(starts)))
    steps = np.asarray(const(inputs[4], "steps")).tolist() if len(inputs) > 4 and inputs[4] is not None \
        else [1] * len(starts)
    rank = nd + 2
    spatial = sorted(a % rank for a in axes)
    if spatial != list(range(2, rank)) or any(s != 0 for s in starts) or any(e != 1 for e in ends) \
            or any(s != 1 for s in steps):
        raise Refused(f"a slice of a kernel-1 MaxPool's Indices other than each plane's origin (starts {starts}, "
                      f"ends {ends}, axes {axes})")
    return PlaneStarts(every.x)


def output_problem(imp, name):
    """Why model output `name` cannot be lamina's (positions counted ONNX's way, where the batch
    is not a static 1 or the pooled input has more than one channel), or None."""
    x = imp.flat_indices.get(name)
    if x is None:
        return None
    if imp.static.get("N") == 1 and x.spec.shape[0] == 1:
        return None
    return ("MaxPool's Indices as a model output: ONNX counts them over the whole batch and lamina within each "
            "sample's channel plane, which agree only for a static batch of 1 and one channel (subtract each "
            "plane's first position in the model, as PyTorch's exporters write return_indices)")
