"""The ONNX importer against files made to mislead or exhaust it: external data beside the
model (never the working directory's), linear import time, bounded constant folding, and one
clear error (never a traceback) for every malformed node."""
import os

import numpy as np
import pytest

import lamina as lm
from lamina.cli import main

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.external_data_helper import convert_model_to_external_data  # noqa: E402


def model_of(nodes, inputs, outputs, initializers=(), opset=17):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def linear_model(weight):
    return model_of([helper.make_node("MatMul", ["x", "W"], ["y"], name="mm")],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                    [numpy_helper.from_array(weight, "W")])


def save_with_external_weights(folder, weight, location="w.bin"):
    folder.mkdir(parents=True, exist_ok=True)
    model = linear_model(weight)
    convert_model_to_external_data(model, all_tensors_to_one_file=True, location=location, size_threshold=0)
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def test_external_data_is_read_beside_the_model_not_in_the_working_directory(tmp_path, monkeypatch):
    rng = np.random.default_rng(0)
    real, decoy = rng.standard_normal((2, 4, 3)).astype(np.float32)
    path = save_with_external_weights(tmp_path / "model", real)
    save_with_external_weights(tmp_path / "elsewhere", decoy)  # another model's w.bin in the cwd
    monkeypatch.chdir(tmp_path / "elsewhere")
    x = rng.standard_normal((2, 4)).astype(np.float32)
    for source in (path, os.path.relpath(path)):
        net = lm.onnx.load(source)
        np.testing.assert_allclose(net.run({"x": x})["y"], x @ real, rtol=1e-6)
    assert main(["import", str(path), "-o", str(tmp_path / "m.lamina")]) == 0
    np.testing.assert_allclose(lm.load(tmp_path / "m.lamina").run({"x": x})["y"], x @ real, rtol=1e-6)
    with pytest.raises(lm.ModelFileError, match=r"tensor 'W' is kept in the external file 'w.bin'; load the "
                                                r"model from its path"):
        lm.onnx.load(path.read_bytes())


@pytest.mark.parametrize("location, why", [("../w.bin", "points outside the directory"),
                                           ("LINK", "symbolic link"),
                                           ("ABSOLUTE", "should be a relative path")])
def test_external_data_that_leaves_the_models_folder_is_refused(tmp_path, location, why):
    weight = np.ones((4, 3), np.float32)
    save_with_external_weights(tmp_path, weight)  # tmp_path/w.bin, outside the model's folder below
    if location == "LINK":
        (tmp_path / "model").mkdir()
        os.symlink(tmp_path / "w.bin", tmp_path / "model" / "link.bin")
        location = "link.bin"
    elif location == "ABSOLUTE":
        location = str(tmp_path / "w.bin")
    model = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    (tmp_path / "model").mkdir(exist_ok=True)
    onnx.save(model, str(tmp_path / "model" / "model.onnx"))
    with pytest.raises(lm.ModelFileError, match=f"tensor 'W' in external file .* cannot be read: .*{why}"):
        lm.onnx.load(tmp_path / "model" / "model.onnx")


def test_external_data_past_the_end_of_its_file_is_one_line_from_the_command(tmp_path, capsys):
    path = save_with_external_weights(tmp_path, np.ones((4, 3), np.float32))
    with open(tmp_path / "w.bin", "r+b") as f:
        f.truncate(20)
    assert main(["import", str(path), "-o", str(tmp_path / "m.lamina")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("lamina import: ") and "tensor 'W' in external file 'w.bin'" in err and "exceeds" in err
    assert "\n" not in err and not (tmp_path / "m.lamina").exists()


def relu_chain(n):
    nodes = [helper.make_node("Relu", [f"t{i}"], [f"t{i + 1}"]) for i in range(n)]
    return model_of(nodes, [helper.make_tensor_value_info("t0", TensorProto.FLOAT, ["N", 4])],
                    [helper.make_tensor_value_info(f"t{n}", TensorProto.FLOAT, ["N", 4])])


def test_a_long_chain_of_unnamed_nodes_imports_with_linear_naming_work(monkeypatch):
    """Each fresh layer name is found by a bounded number of lookups, not by scanning every
    name taken so far (20,000 nodes took 100 s that way)."""
    class CountingSet(set):
        lookups = 0

        def __contains__(self, item):
            CountingSet.lookups += 1
            return super().__contains__(item)
    made = []
    original = lm.Network.__init__

    def counting_init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self._layer_names = CountingSet()
        made.append(self)
    monkeypatch.setattr(lm.Network, "__init__", counting_init)
    n = 10_000
    net = lm.onnx.load(relu_chain(n))
    assert made and 0 < CountingSet.lookups <= 2 * n
    x = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)
    np.testing.assert_array_equal(net.run({"t0": x})[f"t{n}"], np.maximum(x, 0))
    assert len({layer.name for layer in net.layers}) == n


def test_constant_folding_is_bounded_before_it_allocates():
    import resource
    shape = numpy_helper.from_array(np.array([20000, 20000], np.int64), "s")
    model = model_of([helper.make_node("ConstantOfShape", ["s"], ["c"], name="huge"),
                      helper.make_node("Add", ["x", "c"], ["y"], name="add")],
                     [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 20000])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 20000])], [shape])
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(lm.onnx.UnsupportedModelError,
                       match=r"node 'huge' \(ConstantOfShape\): folding this node of constants would allocate "
                             r"1,600,000,000 bytes, more than the 268,435,456"):
        lm.onnx.load(model)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000  # kB
    # many folds under the per-node limit still stop at the model's budget
    nodes = [helper.make_node("ConstantOfShape", ["s"], [f"c{i}"], name=f"fill{i}") for i in range(6)]
    nodes += [helper.make_node("Sum", ["x"] + [f"c{i}" for i in range(6)], ["y"], name="sum")]
    shape = numpy_helper.from_array(np.array([8000, 6000], np.int64), "s")  # 192 MB each
    model = model_of(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 6000])],
                     [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 6000])], [shape])
    with pytest.raises(lm.onnx.UnsupportedModelError, match=r"node 'fill5' .* past 1,073,741,824"):
        lm.onnx.load(model)


def conv_model(**attributes):
    weight = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), "W")
    return model_of([helper.make_node("Conv", ["x", "W"], ["y"], kernel_shape=[3, 3], **attributes)],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 8, 8])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 2, "h", "w"])], [weight])


def lstm_without_hidden_size():
    w = numpy_helper.from_array(np.ones((1, 16, 3), np.float32), "W")
    r = numpy_helper.from_array(np.ones((1, 16, 4), np.float32), "R")
    return model_of([helper.make_node("LSTM", ["x", "W", "R"], ["y"], layout=1)],
                    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", 3])],
                    [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", "T", 1, 4])], [w, r])


def nan_weights():
    return linear_model(np.full((4, 3), np.nan, np.float32))


def string_weights():
    model = linear_model(np.ones((4, 3), np.float32))
    model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.array([["a"] * 3] * 4, dtype=object), "W"))
    return model


def newer_opset():
    model = linear_model(np.ones((4, 3), np.float32))
    model.opset_import[0].version = 9999
    return model


@pytest.mark.parametrize("make, message", [
    (nan_weights, r"node 'mm' \(MatMul\): weight holds NaN or infinity"),
    (string_weights, r"node 'mm' \(MatMul\): B \(the second operand\) is a tensor of object"),
    (lambda: conv_model(strides=[0, 0]), r"node '#0 Conv' \(Conv\): Conv2d: kernel_size, stride and dilation must "
                                         r"be at least 1 .* \(0, 0\)"),
    (lambda: conv_model(pads=[-1, -1, -1, -1]), r"node '#0 Conv' \(Conv\): .*padding at least 0.*\(-1, -1\)"),
    (lstm_without_hidden_size, r"node '#0 LSTM' \(LSTM\): the required attribute 'hidden_size' is missing"),
    (newer_opset, r"the model asks for ONNX opset 9999; the onnx package .* knows opsets up to \d+"),
])
def test_malformed_nodes_are_one_line_refusals_from_the_command(tmp_path, capsys, make, message):
    path = tmp_path / "bad.onnx"
    onnx.save(make(), str(path))
    out = tmp_path / "m.lamina"
    assert main(["import", str(path), "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"lamina import: {path}: ") and "Traceback" not in err
    import re
    assert re.search(message, err), err
    assert not out.exists()
