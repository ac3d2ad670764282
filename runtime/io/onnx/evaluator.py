"""onnx's reference evaluator, which the importer folds constants and checks subgraphs with, with
its GatherElements replaced: onnx's picks with `np.choose`, which takes at most 64 choices, and
its fallback returns a wrong shape (BERT's token types gathered from a buffer of 512 positions)."""
import numpy as np


def reference_evaluator(proto, **kwargs):
    """onnx.reference.ReferenceEvaluator(proto, **kwargs) with this module's operators."""
    from onnx.reference import ReferenceEvaluator
    return ReferenceEvaluator(proto, new_ops=[_gather_elements()], **kwargs)


def _gather_elements():
    from onnx.reference.op_run import OpRun

    class GatherElements(OpRun):
        op_domain = ""

        def _run(self, data, indices, axis=None):
            axis = 0 if axis is None else int(axis)
            size = data.shape[axis]
            if indices.size and (indices.min() < -size or indices.max() >= size):
                raise IndexError(f"GatherElements: indices outside [-{size}, {size}) along axis {axis}")
            return (np.take_along_axis(data, np.where(indices < 0, indices + size, indices), axis=axis),)
    return GatherElements
