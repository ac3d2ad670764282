"""The Resize layer (nearest and linear resampling of 1 to 3 spatial axes): float64 gradients,
PyTorch's interpolate as the reference, every backend the tests have, and the model file."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import Resize
from lamina.testing import check_gradients

from test_layers import probed

torch = pytest.importorskip("torch")
F = torch.nn.functional

# (input [C, *spatial], output size, lamina's options, torch.nn.functional.interpolate's)
CASES = [
    ((2, 5), (11,), dict(mode="linear", coordinates="pytorch_half_pixel"), dict(mode="linear")),
    ((2, 5), (3,), dict(mode="linear", coordinates="align_corners"), dict(mode="linear", align_corners=True)),
    ((3, 4, 5), (8, 10), dict(mode="nearest", coordinates="asymmetric", rounding="floor"), dict(mode="nearest")),
    ((3, 4, 5), (7, 9), dict(mode="nearest", coordinates="half_pixel", rounding="round_prefer_ceil"),
     dict(mode="nearest-exact")),
    ((3, 4, 5), (8, 3), dict(mode="linear", coordinates="pytorch_half_pixel"), dict(mode="bilinear")),
    ((3, 4, 5), (9, 10), dict(mode="linear", coordinates="align_corners"), dict(mode="bilinear", align_corners=True)),
    ((2, 3, 4, 2), (6, 8, 4), dict(mode="linear", coordinates="pytorch_half_pixel"), dict(mode="trilinear")),
    ((2, 3, 4, 2), (6, 8, 4), dict(mode="nearest", coordinates="asymmetric", rounding="floor"), dict(mode="nearest")),
]
IDS = [f"{len(c[0]) - 1}d-{c[3]['mode']}{'-corners' if c[3].get('align_corners') else ''}-{'x'.join(map(str, c[1]))}"
       for c in CASES]


@pytest.mark.parametrize("shape,size,options,theirs", CASES, ids=IDS)
def test_resize_follows_pytorch_interpolate(shape, size, options, theirs):
    from conftest import OPENCL_DEVICES
    net = lm.Network()
    net.outputs(y=Resize(size, **options)(net.input("x", shape)))
    x = np.random.default_rng(len(shape)).standard_normal((3,) + shape).astype(np.float32)
    expected = F.interpolate(torch.from_numpy(x), size=size, **theirs).numpy()
    for device in ["cpu"] + (["opencl"] if OPENCL_DEVICES else []):
        np.testing.assert_allclose(net.to(device).run({"x": x})["y"], expected, rtol=1e-5, atol=1e-6,
                                   err_msg=device)


@pytest.mark.parametrize("shape,size,options,theirs", CASES, ids=IDS)
def test_resize_gradients(shape, size, options, theirs):
    net, feeds, _ = probed(lambda x: Resize(size, **options)(x), [shape])
    check_gradients(net, feeds)


def test_resize_gradient_follows_pytorch():
    """Downsampling linearly, where several outputs read one input and some read none."""
    x = torch.randn(2, 3, 9, 7, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 4, 5, dtype=torch.float64)
    F.interpolate(x, size=(4, 5), mode="bilinear").backward(dy)
    net = lm.Network(dtype="float64")
    xin = net.input("x", (3, 9, 7))
    xin.requires_grad = True
    net.outputs(y=Resize((4, 5), mode="linear", coordinates="pytorch_half_pixel")(xin))
    net.forward({"x": x.detach().numpy()}, grad_outputs=["y"])
    net.backward(grad_outputs={"y": dy.numpy()})
    np.testing.assert_allclose(net.grad("x"), x.grad.numpy(), rtol=1e-12, atol=1e-12)


def test_resize_round_trips_through_the_model_file(tmp_path):
    net = lm.Network()
    net.outputs(y=Resize((6, 7), mode="linear", coordinates="align_corners", scales=(1.5, 1.75))(net.input("x", (2, 4, 4))))
    lm.save(net, tmp_path / "resize.lamina")
    back = lm.load(tmp_path / "resize.lamina")
    x = np.random.default_rng(0).standard_normal((2, 2, 4, 4)).astype(np.float32)
    np.testing.assert_array_equal(back.run({"x": x})["y"], net.run({"x": x})["y"])


@pytest.mark.parametrize("bad,match", [(dict(size=()), "1 to 3 spatial sizes"), (dict(size=(2, 0)), "at least 1"),
                                       (dict(size=(2,), mode="cubic"), "mode must be one of"),
                                       (dict(size=(2,), coordinates="tf_crop_and_resize"), "coordinates must be"),
                                       (dict(size=(2,), scales=(0.0,)), "positive numbers")])
def test_resize_refuses_bad_settings(bad, match):
    with pytest.raises(ValueError, match=match):
        Resize(**bad)


def test_resize_refuses_an_input_of_other_rank():
    net = lm.Network()
    with pytest.raises(ValueError, match="2 spatial axes"):
        Resize((4, 4))(net.input("x", (3, 5)))


@pytest.mark.parametrize("options", [dict(mode="linear", coordinates="half_pixel"),
                                     dict(mode="nearest", coordinates="asymmetric", rounding="floor"),
                                     dict(mode="linear", coordinates="align_corners", scales=(1.5, 1.75))],
                         ids=["sizes-linear", "sizes-nearest", "scales-corners"])
def test_resize_exports_as_onnx_resize(options, tmp_path):
    """ONNX Runtime computes what lamina does, and the file imports back as the same layer."""
    ort = pytest.importorskip("onnxruntime")
    net = lm.Network()
    net.outputs(y=Resize((6, 7), **options)(net.input("x", (2, 4, 4))))
    lm.onnx.save(net, tmp_path / "resize.onnx")
    x = np.random.default_rng(1).standard_normal((3, 2, 4, 4)).astype(np.float32)
    ours = net.run({"x": x})["y"]
    theirs = ort.InferenceSession(str(tmp_path / "resize.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-6)
    back = lm.onnx.load(tmp_path / "resize.onnx")
    assert [layer.kind for layer in back.layers] == ["resize"]
    np.testing.assert_array_equal(back.run({"x": x})["y"], ours)


PAD_CASES = [((2, 5), ((0, 0), (2, 3)), "constant", "constant"), ((2, 5), ((0, 0), (3, 1)), "reflect", "reflect"),
             ((2, 4, 5), ((0, 0), (1, 2), (2, 0)), "edge", "replicate"),
             ((2, 4, 5), ((0, 0), (2, 1), (1, 3)), "wrap", "circular"),
             ((2, 4, 5), ((1, 0), (-1, 2), (0, -2)), "constant", "constant"),
             ((2, 3, 4, 5), ((0, 0), (1, 1), (2, 0), (0, 3)), "reflect", "reflect")]
PAD_IDS = [f"{m}-{len(s) - 1}d" + ("-crop" if any(b < 0 or a < 0 for b, a in p) else "") for s, p, m, _ in PAD_CASES]


@pytest.mark.parametrize("shape,pads,mode,torch_mode", PAD_CASES, ids=PAD_IDS)
def test_pad_follows_pytorch(shape, pads, mode, torch_mode):
    """Every mode against torch.nn.functional.pad (negative pads crop) on the CPU and OpenCL, and
    float64 gradients."""
    from conftest import OPENCL_DEVICES
    net = lm.Network()
    net.outputs(y=lm.layers.Pad(pads, mode=mode)(net.input("x", shape)))
    x = np.random.default_rng(len(shape)).standard_normal((3,) + shape).astype(np.float32)
    flat = [v for b, a in reversed(pads[1:] if torch_mode != "constant" else pads) for v in (b, a)]
    if torch_mode == "constant":
        expected = F.pad(torch.from_numpy(x), flat).numpy()
    else:  # (PyTorch's non-constant modes pad the spatial axes of [N, C, *spatial])
        expected = F.pad(torch.from_numpy(x), flat, mode=torch_mode).numpy()
    for device in ["cpu"] + (["opencl"] if OPENCL_DEVICES else []):
        np.testing.assert_allclose(net.to(device).run({"x": x})["y"], expected, rtol=0, atol=0, err_msg=device)
    net, feeds, _ = probed(lambda v: lm.layers.Pad(pads, mode=mode)(v), [shape])
    check_gradients(net, feeds)


@pytest.mark.parametrize("mode", ["constant", "reflect", "edge", "wrap"])
def test_pad_exports_and_imports_back(mode, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    net = lm.Network()
    net.outputs(y=lm.layers.Pad(((0, 0), (1, 2), (2, 1)), mode=mode)(net.input("x", (2, 4, 5))))
    lm.onnx.save(net, tmp_path / "pad.onnx")
    x = np.random.default_rng(2).standard_normal((3, 2, 4, 5)).astype(np.float32)
    ours = net.run({"x": x})["y"]
    theirs = ort.InferenceSession(str(tmp_path / "pad.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(theirs, ours)
    back = lm.onnx.load(tmp_path / "pad.onnx")
    assert [layer.kind for layer in back.layers] == ["pad"]
    np.testing.assert_array_equal(back.run({"x": x})["y"], ours)


def test_a_pad_value_other_than_zero_imports_as_a_fixed_bias():
    """torch's F.pad(x, value=1.5) (a constant Pad with a value): ONNX Runtime's answer, and the
    fill is not trained."""
    import io
    ort = pytest.importorskip("onnxruntime")
    f = io.BytesIO()
    torch.onnx.export(_PadValue(), (torch.randn(2, 3, 4, 5),), f, dynamo=False, input_names=["x"])
    net = lm.onnx.load(f.getvalue())
    x = np.random.default_rng(3).standard_normal((2, 3, 4, 5)).astype(np.float32)
    theirs = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    (name,) = net.output_values
    np.testing.assert_allclose(net.run({"x": x})[name], theirs, rtol=1e-6, atol=1e-6)
    assert all(p.frozen for layer in net.layers if layer.kind == "bias" for p in layer.params.values())


class _PadValue(torch.nn.Module):
    def forward(self, x):
        return F.pad(x, (1, 2, 0, 1), value=1.5) * 2


@pytest.mark.parametrize("axes,mode", [((1,), "mean"), ((0, 2), "sum"), ((0, 1, 2), "mean")])
def test_reduce_follows_pytorch(axes, mode):
    """Sum and mean over any of a sample's axes (kept with size 1) on the CPU and OpenCL, float64
    gradients."""
    from conftest import OPENCL_DEVICES
    net = lm.Network()
    net.outputs(y=lm.layers.Reduce(axes, mode=mode)(net.input("x", (3, 4, 5))))
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5)).astype(np.float32)
    t = torch.from_numpy(x)
    dims = tuple(a + 1 for a in axes)
    expected = (t.mean(dims, keepdim=True) if mode == "mean" else t.sum(dims, keepdim=True)).numpy()
    for device in ["cpu"] + (["opencl"] if OPENCL_DEVICES else []):
        np.testing.assert_allclose(net.to(device).run({"x": x})["y"], expected, rtol=1e-5, atol=1e-6, err_msg=device)
    net, feeds, _ = probed(lambda v: lm.layers.Reduce(axes, mode=mode)(v), [(3, 4, 5)])
    check_gradients(net, feeds)


def test_reduce_exports_and_imports_back(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    net = lm.Network()
    x = net.input("x", (3, 4, 5))
    net.outputs(m=lm.layers.Reduce((2,))(x), s=lm.layers.Reduce((0, 1), mode="sum")(x))
    lm.onnx.save(net, tmp_path / "reduce.onnx")
    feed = np.random.default_rng(6).standard_normal((2, 3, 4, 5)).astype(np.float32)
    ours = net.run({"x": feed})
    session = ort.InferenceSession(str(tmp_path / "reduce.onnx"), providers=["CPUExecutionProvider"])
    for name, theirs in zip([o.name for o in session.get_outputs()], session.run(None, {"x": feed})):
        np.testing.assert_allclose(theirs, ours[name], rtol=1e-5, atol=1e-6)
    back = lm.onnx.load(tmp_path / "reduce.onnx").run({"x": feed})
    for name in ("m", "s"):
        np.testing.assert_allclose(back[name], ours[name], rtol=1e-6, atol=1e-6)


def test_an_output_sized_past_the_limit_is_refused_before_it_is_made():
    """A Resize whose sizes ask for a 2^20 x 2^20 plane (a damaged or hostile file) is refused by
    name at import, before any table or buffer of that size exists."""
    from onnx import TensorProto, helper, numpy_helper
    sizes = numpy_helper.from_array(np.array([1, 2, 1 << 20, 1 << 20], np.int64), "sizes")
    node = helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="huge")
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 2, 1 << 20, 1 << 20])], [sizes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    with pytest.raises(lm.onnx.UnsupportedModelError, match="huge.*more than the"):
        lm.onnx.load(model)
