"""The batch sorted by length and restored: PyTorch's pack_padded_sequence(enforce_sorted=False).

Its export sorts the batch by the lengths (TopK), gathers the rows in that order before the
recurrent node (whose sequence_lens are the sorted lengths), and gathers its outputs back with
the inverse order (built by ScatterElements of Range(0, N) at the sorted indices). lamina's
recurrent layers take sequences in any order, so the two gathers cancel: each becomes the value
itself. That is exact only where every value computed in the sorted order is restored before it
meets a value in the original order or leaves the graph; the importer tracks which ONNX tensors
are in the sorted order (`Importer.sorted_rows`) and refuses any other use by node.
"""
import numpy as np

from ....graph import Value
from ..registry import Refused, converter
from ..shapes import BatchOrder, SortedLengths, Symbolic, Zeros

MARKERS = (BatchOrder, SortedLengths)


@converter("TopK", attributes={"axis", "largest", "sorted"})
def top_k(imp, node, inputs, attrs):
    """TopK of one integer per sample over the whole batch: the values in sorted order and the
    order itself."""
    x, k = inputs[0], inputs[1]
    if not (isinstance(x, Value) and x.spec.kind == "int32" and x.spec.shape == () and not x.spec.sequence):
        raise Refused("TopK other than of one integer per sample (sequence lengths) over the whole batch")
    if not (isinstance(k, Symbolic) and [e for e in np.ravel(k.values)] == ["N"]):
        raise Refused("TopK of fewer than all of the batch's rows")
    if attrs.get("axis", -1) not in (0, -1):
        raise Refused(f"axis {attrs['axis']}")
    return [SortedLengths(x), BatchOrder("sorted")]


RECURRENT = ("LSTM", "GRU", "RNN")


def handles(node, inputs):
    """Whether marker_op converts this node: it reads an order or the sorted lengths other than
    as a recurrent node's sequence_lens (the recurrent converter reads those)."""
    return any(isinstance(v, MARKERS) and not (node.op_type in RECURRENT and k == 4 and isinstance(v, SortedLengths))
               for k, v in enumerate(inputs))


def marker_op(imp, node, inputs, attrs):
    """An operator reading a BatchOrder or the sorted lengths (the importer calls this for them)."""
    op, first = node.op_type, inputs[0]
    if op in ("Cast", "Identity") and isinstance(first, MARKERS):
        return [first]
    if op == "Shape" and isinstance(first, MARKERS):
        return [Symbolic(["N"])]
    if op == "ScatterElements" and attrs.get("axis", 0) == 0 and "reduction" not in attrs and \
            isinstance(first, Zeros) and isinstance(inputs[1], BatchOrder) and inputs[1].kind == "sorted" and \
            isinstance(inputs[2], BatchOrder) and inputs[2].kind == "identity":
        return [BatchOrder("inverse")]  # out[sorted[i]] = i
    if op == "Gather" and isinstance(first, Value) and isinstance(inputs[1], BatchOrder):
        return [_reordered(imp, node, first, inputs[1].kind, attrs.get("axis", 0))]
    if isinstance(first, SortedLengths) or any(isinstance(v, SortedLengths) for v in inputs):
        raise Refused("the lengths in sorted order read other than as a recurrent node's sequence_lens")
    raise Refused("a use of the batch's order by length other than gathering rows in it and back")


def _reordered(imp, node, x, kind, axis):
    """Gather of x's rows in the sorted order or back: x itself, its tensor marked as sorted or
    restored."""
    axes = imp.axes_of(x)
    if not -len(axes) <= axis < len(axes) or axes[axis] != "N":
        raise Refused(f"a gather in the batch's order by length along axis {axis}, not the batch axis")
    source = node.input[0]
    if kind == "sorted":
        if source in imp.sorted_rows:
            raise Refused("rows sorted by length twice")
        imp.sorted_rows.add(node.output[0])
    elif kind == "inverse":
        if source not in imp.sorted_rows:
            raise Refused("rows put back from the order by length that were never sorted")
    else:
        raise Refused("a gather by Range(0, N)")
    return x


def unsorted_lengths(lengths):
    """A recurrent node's sequence_lens: the sorted lengths are the lengths input itself (the rows
    they go with are taken in the original order)."""
    return lengths.value if isinstance(lengths, SortedLengths) else lengths
