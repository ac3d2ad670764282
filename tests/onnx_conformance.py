"""ONNX's own node conformance cases (built in memory by onnx.backend.test) through lm.onnx.load.

The cases feed weights as graph inputs; each case's weights are constants, so the harness turns
every input that is not data (per operator, below) into an initializer, feeds the rest by name,
and compares lamina's outputs with the case's expected ones. A case ends as passed, refused (the
importer's UnsupportedModelError, whose reason is kept) or failed (wrong numbers or an error).

`python tests/onnx_conformance.py` prints the table of docs/onnx.md (cases passed / failed / refused
per operator, and the refusals' reasons).
"""
import collections
import sys
import warnings
from pathlib import Path

import numpy as np

# operator -> positions of the inputs that are data (the rest are weights: initializers)
DATA_INPUTS = {
    "Gemm": (0,), "MatMul": (0,), "Conv": (0,), "ConvTranspose": (0,), "MaxPool": (0,), "AveragePool": (0,),
    "GlobalAveragePool": (0,), "BatchNormalization": (0,), "Gather": (1,), "Relu": (0,), "LeakyRelu": (0,),
    "Sigmoid": (0,), "Tanh": (0,), "Softmax": (0,), "Add": (0, 1), "Sub": (0, 1), "Concat": None,
    "Dropout": (0,), "Identity": (0,), "Flatten": (0,), "Reshape": (0,),
    "PRelu": (0,), "Elu": (0,), "Selu": (0,), "Gelu": (0,), "HardSigmoid": (0,), "HardSwish": (0,),
    "Softplus": (0,), "Softsign": (0,), "LogSoftmax": (0,), "Mul": (0, 1), "Div": (0, 1),
    "RNN": (0,), "LSTM": (0,), "GRU": (0,), "Pow": (0,), "ReduceMean": (0,), "Slice": (0,), "Transpose": (0,), "Expand": (0,),
    "SoftmaxCrossEntropyLoss": (0, 1), "Clip": (0,), "Split": (0,), "Resize": (0,), "Upsample": (0,), "Pad": (0,), "DepthToSpace": (0,), "SpaceToDepth": (0,), "Tile": (0,), "ReduceSum": (0,),
    "Sqrt": (0,), "Reciprocal": (0,), "Log": (0,), "Abs": (0,), "Erf": (0,), "Neg": (0,), "Exp": (0,), "Unsqueeze": (0,),
    "Squeeze": (0,), "LayerNormalization": (0,), "RMSNormalization": (0,), "InstanceNormalization": (0,),
    "GroupNormalization": (0,), "ReduceMax": (0,), "GlobalMaxPool": (0,), "Mish": (0,), "Celu": (0,),
    "Where": (0, 1, 2), "Greater": (0, 1), "Less": (0, 1), "GreaterOrEqual": (0, 1), "LessOrEqual": (0, 1),
    "Equal": (0, 1), "Not": (0,), "And": (0, 1), "Or": (0, 1), "Xor": (0, 1), "Sign": (0,),
}


RECURRENT = ("RNN", "LSTM", "GRU")


def cases():
    """The node cases of the listed operators (not the '_expanded' function bodies)."""
    from onnx.backend.test.case.node import collect_testcases
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = collect_testcases()
    return sorted((c for c in found if c.model is not None and not c.name.endswith("_expanded")
                   and c.model.graph.node[0].op_type in DATA_INPUTS and len(c.model.graph.node) == 1),
                  key=lambda c: c.name)


def with_initializers(case):
    """The case's model with its weights as initializers, and the data feeds of each data set."""
    import onnx
    from onnx import numpy_helper
    model = onnx.ModelProto()
    model.CopyFrom(case.model)
    node = model.graph.node[0]
    data_pos = DATA_INPUTS[node.op_type]
    inputs, expected = case.data_sets[0]
    names = [i.name for i in model.graph.input]
    data_names = [n for i, n in enumerate(node.input) if n and (data_pos is None or i in data_pos)]
    keep = [i for i in model.graph.input if i.name in data_names]
    for name, array in zip(names, inputs):
        if name not in data_names:
            model.graph.initializer.append(numpy_helper.from_array(np.asarray(array), name))
    del model.graph.input[:]
    model.graph.input.extend(keep)
    feeds = {}
    for name, array in zip(names, inputs):
        if name in data_names:
            a = np.asarray(array)
            feeds[name] = a.astype(np.float32) if a.dtype.kind in "fb" else a  # (bools: masks of 0 and 1)
    return model, feeds, [np.asarray(e) for e in expected]


def run_case(case):
    """('passed' | 'refused' | 'failed', detail)."""
    import lamina as lm
    from lamina.io.onnx import to_onnx_layout
    model, feeds, expected = with_initializers(case)
    node = model.graph.node[0]
    if node.op_type in RECURRENT:  # X is a padded batch of sequences, time-major unless layout=1
        layout = {a.name: a.i for a in node.attribute}.get("layout", 0)
        x = feeds[node.input[0]]
        padded = x if layout else x.transpose(1, 0, 2)
        feeds[node.input[0]] = lm.Sequences.from_padded(padded, [padded.shape[1]] * len(padded))
    try:
        net = lm.onnx.load(model)  # (a recurrent node's fixed [T, N, C] X is taken as sequences)
    except lm.onnx.UnsupportedModelError as e:
        return "refused", "; ".join(what for _, _, what in e.problems)
    except Exception as e:  # an importer bug: a failure, not a refusal
        return "failed", f"load: {type(e).__name__}: {e}"
    try:
        out = net.run(feeds)
    except Exception as e:
        return "failed", f"run: {type(e).__name__}: {e}"
    for o, want in zip(model.graph.output, expected):
        got = out.get(o.name)
        if got is None:
            return "failed", f"no output {o.name!r}"
        got = to_onnx_layout(got, net.onnx_axes[o.name])
        if got.shape != want.shape:
            return "failed", f"output {o.name!r} has shape {got.shape}, expected {want.shape}"
        tol = dict(rtol=max(case.rtol, 1e-5), atol=max(case.atol, 1e-6)) if want.dtype.kind == "f" else {}
        if want.dtype.kind == "f" and want.dtype != np.float32:
            tol = dict(rtol=max(tol["rtol"], 1e-5), atol=max(tol["atol"], 1e-5))
        if not np.allclose(got, want, equal_nan=True, **tol):
            err = float(np.max(np.abs(got.astype(np.float64) - want)))
            return "failed", f"output {o.name!r} differs by up to {err:.3g}"
    return "passed", ""


def table():
    results = collections.defaultdict(lambda: {"passed": 0, "failed": 0, "refused": 0, "reasons": collections.Counter()})
    for case in cases():
        outcome, detail = run_case(case)
        row = results[case.model.graph.node[0].op_type]
        row[outcome] += 1
        if outcome != "passed":
            row["reasons"][detail] += 1
    lines = ["| operator | passed | failed | refused | why (cases) |", "|---|---|---|---|---|"]
    for op in sorted(DATA_INPUTS):
        row = results.get(op)
        if row is None:
            continue
        why = "; ".join(f"{r} ({n})" for r, n in row["reasons"].most_common())
        lines.append(f"| {op} | {row['passed']} | {row['failed']} | {row['refused']} | {why.replace('|', '/')} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    print(table())
