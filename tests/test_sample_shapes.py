"""Inputs whose sample shape each batch sets (lamina.sample_shapes): ONNX models exported with
dynamic axes after the batch (images of any height and width, volumes of any size), and networks
built in Python with `input(..., dynamic=)`. Each batch runs on the network made for its shapes,
and every such network shares the base network's parameters."""
import io
import warnings

import numpy as np
import pytest

import lamina as lm
from lamina import sample_shapes
from lamina.errors import InputError, ModelFileError

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
from test_onnx_models import build  # noqa: E402  (the blocks of the architectures users export)

L = lm.layers

# model -> (example input, the axes of it that are dynamic besides the batch, shapes to run at)
CASES = {
    # LRASPP/FCN's ending: upsampled to the input's own height and width (sizes read from its shape)
    "segmentation": (torch.randn(2, 3, 32, 32), (2, 3), [(1, 3, 40, 56), (3, 3, 17, 23), (1, 3, 40, 56)]),
    "resnet": (torch.randn(2, 3, 32, 32), (2, 3), [(1, 3, 48, 40), (2, 3, 24, 24)]),
    "mobilenet_v2": (torch.randn(2, 3, 32, 32), (2, 3), [(1, 3, 64, 48)]),
    "unet3d": (torch.randn(1, 1, 8, 8, 8), (2, 3, 4), [(1, 1, 4, 12, 8), (2, 1, 16, 8, 4)]),
}


def export(model, example, axes, dynamo):
    """ONNX bytes with the batch and `axes` of the input dynamic."""
    f = io.BytesIO()
    if dynamo:
        dims = {0: torch.export.Dim("batch", max=64)}
        dims.update({a: torch.export.Dim(f"size{a}", min=4, max=256) for a in axes})
        kw = {"dynamic_shapes": (dims,)}
    else:
        kw = {"dynamic_axes": {"x": {0: "batch", **{a: f"size{a}" for a in axes}}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), f, dynamo=dynamo, input_names=["x"], verbose=False, **kw)
    return f.getvalue()


def onnx_runtime(blob, x):
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def assert_matches(ours, theirs):
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * max(float(np.abs(theirs).max()), 1e-3))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_dynamic_sample_axes_run_at_every_size(name, dynamo):
    """A model exported with dynamic height and width (depth too) runs at sizes other than the
    export's, as ONNX Runtime and PyTorch do, on the network made for each."""
    model = build(name)
    example, axes, shapes = CASES[name]
    blob = export(model, example, axes, dynamo)
    net = lm.onnx.load(blob)
    assert sorted(net.dynamic_axes["x"]) == [a - 1 for a in axes]
    assert net.get_inputs()[0].shape[0] == "N"
    assert all(isinstance(net.get_inputs()[0].shape[a], str) for a in axes)
    rng = np.random.default_rng(3)
    for shape in shapes:
        x = rng.standard_normal(shape).astype(np.float32)
        (ours,) = net.run({"x": x}).values()
        assert_matches(ours, onnx_runtime(blob, x))
        with torch.no_grad():
            assert_matches(ours, model(torch.from_numpy(x)).numpy())


def test_first_import_at_given_shapes():
    model = build("segmentation")
    blob = export(model, torch.randn(2, 3, 32, 32), (2, 3), dynamo=True)
    assert lm.onnx.load(blob).values["x"].spec.shape == (3, 224, 224)  # the default example size
    net = lm.onnx.load(blob, shapes={"x": (3, 48, 64)})
    assert net.values["x"].spec.shape == (3, 48, 64)
    x = np.random.default_rng(0).standard_normal((2, 3, 48, 64)).astype(np.float32)
    assert not net._specializations.kept  # its own shape: no other network made
    assert_matches(net.run({"x": x})[net.get_outputs()[0].name], onnx_runtime(blob, x))
    assert not net._specializations.kept
    with pytest.raises(ModelFileError, match=r"shapes\['x'\] is \[4, 48, 64\]; the input's sample shape is \[3, '\?', '\?'\]"):
        lm.onnx.load(blob, shapes={"x": (4, 48, 64)})
    with pytest.raises(ModelFileError, match="shapes names 'y', which is no input with dynamic axes"):
        lm.onnx.load(blob, shapes={"y": (3, 8, 8)})


def test_a_fixed_axis_is_still_checked():
    blob = export(build("segmentation"), torch.randn(2, 3, 32, 32), (2, 3), dynamo=False)
    net = lm.onnx.load(blob)
    with pytest.raises(InputError, match=r"input 'x': expected shape \(batch, 3, size2, size3\), found \(2, 4, 20, 20\)"):
        net.run({"x": np.zeros((2, 4, 20, 20), np.float32)})
    with pytest.raises(InputError, match="at least 1"):
        net.run({"x": np.zeros((2, 3, 0, 20), np.float32)})


def test_fine_tuning_at_several_sizes_trains_one_set_of_parameters():
    """A loss added to the imported segmentation model, its target declared with the same dynamic
    axes, trains at two sizes. Each step equals the same step of the model exported at that size
    alone (static shapes) from the same weights: the loss, and every parameter after the update;
    and the made networks hold the base network's parameters."""
    model = build("segmentation")
    blob = export(model, torch.randn(2, 3, 32, 32), (2, 3), dynamo=True)
    net = lm.onnx.load(blob)
    out = net.values[net.output_values[net.get_outputs()[0].name]]
    target = net.input("target", out.spec.shape, dynamic=(1, 2))
    net.outputs(loss=L.SquareError()(out, target))
    opt = lm.optim.SGD(net, lr=1e-5)
    rng = np.random.default_rng(1)
    for shape in [(24, 40), (17, 19)]:
        x = rng.standard_normal((2, 3) + shape).astype(np.float32)
        t = rng.standard_normal((2, 5) + shape).astype(np.float32)
        alone = lm.onnx.load(export(model, torch.from_numpy(x), (), dynamo=True))
        ours = dict(net.named_parameters())
        for name, p in alone.named_parameters():
            p.assign(ours[name].value)
        y = alone.values[alone.output_values[alone.get_outputs()[0].name]]
        alone.outputs(loss=L.SquareError()(y, alone.input("target", y.spec.shape)))
        loss_alone = alone.train_step({"x": x, "target": t}, lm.optim.SGD(alone, lr=1e-5))
        losses = [net.train_step({"x": x, "target": t}, opt)]
        assert losses[0] == pytest.approx(loss_alone, rel=1e-5)
        for name, p in alone.named_parameters():
            np.testing.assert_allclose(ours[name].value, p.value, rtol=1e-5, atol=1e-7, err_msg=name)
        losses += [net.train_step({"x": x, "target": t}, opt) for _ in range(2)]
        assert losses[-1] < losses[0]
        made = net.for_sample_shapes({"x": (3,) + shape, "target": (5,) + shape})
        assert made is not net and made.values["x"].spec.shape == (3,) + shape
        assert all(p is ours[n] for n, p in made.named_parameters())


def test_outputs_computed_from_an_input_not_fed_are_left_out():
    """Inference feeds the image alone: the loss reading the target is left out of the made network."""
    net, _ = native_network()
    made = net.run({"x": np.ones((1, 3, 7, 9), np.float32)}, ["y"])
    assert made["y"].shape == (1, 2, 7, 9)
    with pytest.raises(InputError, match=r"missing input 'target' \(needed for output 'loss'\)"):
        net.run({"x": np.ones((1, 3, 7, 9), np.float32)}, ["loss"])


def native_network():
    net = lm.Network()
    x = net.input("x", (3, 16, 16), dynamic=(1, 2))
    h = L.Activation("relu")(L.Conv2d(3, 4, 3, padding=1)(x))
    y = L.Conv2d(4, 2, 3, padding=1)(h)
    t = net.input("target", (2, 16, 16), dynamic={1: "H", 2: "W"})
    net.outputs(y=y, loss=L.SquareError()(y, t))
    return net, (h, y)


def test_networks_built_in_python_take_dynamic_axes_and_keep_them_in_model_files(tmp_path):
    net, _ = native_network()
    assert net.get_inputs()[1].shape == ["N", 2, "H", "W"]
    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 3, 11, 6)).astype(np.float32)
    # a network built at that shape with the same layers computes the same
    fixed = lm.Network()
    xi = fixed.input("x", (3, 11, 6))
    conv1, relu, conv2 = (net.layer(n) for n in ("conv2d0", "activation0", "conv2d1"))
    fixed.outputs(y=conv2(relu(conv1(xi))))
    np.testing.assert_array_equal(net.run({"x": x}, ["y"])["y"], fixed.run({"x": x})["y"])
    path = tmp_path / "dynamic.lamina"
    lm.save(net, path)
    back = lm.load(path)
    assert back.dynamic_axes == {"x": {1: "x_1", 2: "x_2"}, "target": {1: "H", 2: "W"}}
    np.testing.assert_array_equal(back.run({"x": x}, ["y"])["y"], fixed.run({"x": x})["y"])


def test_an_imported_models_own_dynamic_axes_are_not_kept_in_lamina_model_files(tmp_path):
    """Its sizes were folded at import (the segmentation head's output size); a lamina model file
    holds the network at its import shape, whose checks refuse other sizes rather than compute
    them wrongly."""
    blob = export(build("segmentation"), torch.randn(2, 3, 32, 32), (2, 3), dynamo=False)
    net = lm.onnx.load(blob, shapes={"x": (3, 16, 16)})
    lm.save(net, tmp_path / "seg.lamina")
    back = lm.load(tmp_path / "seg.lamina")
    assert back.dynamic_axes == {}
    with pytest.raises(InputError, match=r"expected shape \(batch, 3, 16, 16\)"):
        back.run({"x": np.zeros((1, 3, 8, 8), np.float32)})


def test_dynamic_axes_are_checked():
    net = lm.Network()
    with pytest.raises(ValueError, match=r"dynamic axes \[3\] are not among the 3 axes of its shape"):
        net.input("x", (3, 8, 8), dynamic=(3,))
    assert "x" not in net.values


def test_only_the_most_recent_sizes_are_kept():
    net, _ = native_network()
    for size in range(4, 4 + sample_shapes.KEPT + 3):
        net.run({"x": np.ones((1, 3, size, size), np.float32)}, ["y"])
    assert len(net._specializations.kept) == sample_shapes.KEPT
    net.to("cpu")  # a change of the network drops every made network
    assert not net._specializations.kept


def test_bad_model_file_dynamic_axes_are_refused(tmp_path):
    net, _ = native_network()
    path = tmp_path / "m.lamina"
    lm.save(net, path)
    from lamina.io import model as model_file
    graph = model_file.describe_graph(net)
    graph["inputs"][0]["dynamic"] = {"7": "H"}
    with pytest.raises(ModelFileError, match="dynamic axes must map an axis of its shape"):
        model_file._check_graph(str(path), graph, None)


def test_dynamic_sample_axes_on_opencl():
    from conftest import NO_OPENCL, OPENCL_DEVICES
    if not OPENCL_DEVICES:
        pytest.skip(NO_OPENCL)
    model = build("segmentation")
    blob = export(model, torch.randn(2, 3, 32, 32), (2, 3), dynamo=True)
    net = lm.onnx.load(blob).to("opencl")
    x = np.random.default_rng(4).standard_normal((2, 3, 20, 28)).astype(np.float32)
    (ours,) = net.run({"x": x}).values()
    assert_matches(ours, onnx_runtime(blob, x))


def test_training_without_the_target_is_refused():
    net, _ = native_network()
    with pytest.raises(InputError, match=r"missing input 'target' \(needed for output 'loss'\)"):
        net.train_step({"x": np.ones((1, 3, 7, 9), np.float32)}, lm.optim.SGD(net, lr=0.1))
