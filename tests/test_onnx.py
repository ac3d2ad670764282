"""ONNX import: ONNX's own node conformance cases, real PyTorch exports (both exporters), the
refusal of what lamina lacks (every item listed at once), malformed files, fine-tuning an
imported model against PyTorch, and the command's .onnx handling."""
import io
import re
import warnings

import numpy as np
import pytest

import lamina as lm
from lamina.cli import main

import onnx_conformance

import onnx  # noqa: E402  (test extras, installed by make test)
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

CASES = onnx_conformance.cases()


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_onnx_node_conformance(case):
    """Each case passes or is refused with a stated reason; wrong numbers or a crash fail."""
    outcome, detail = onnx_conformance.run_case(case)
    assert outcome != "failed", detail
    if outcome == "refused":
        assert detail


class CNN(torch.nn.Module):
    """Conv2d, BatchNorm2d, ReLU, MaxPool2d, AvgPool2d, Flatten, Linear."""

    def __init__(self, batch_norm=True):
        super().__init__()
        self.c1 = torch.nn.Conv2d(1, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4) if batch_norm else torch.nn.Identity()
        self.pool = torch.nn.MaxPool2d(2)
        self.c2 = torch.nn.Conv2d(4, 8, 3)
        self.avg = torch.nn.AvgPool2d(2)
        self.fc = torch.nn.Linear(8 * 3 * 3, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn(self.c1(x))))
        x = self.avg(torch.relu(self.c2(x)))
        return self.fc(torch.flatten(x, 1))


def export(model, example, dynamo, opset):
    """The model's ONNX bytes from torch.onnx.export, batch axis dynamic."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (example,), f, dynamo=True, opset_version=opset, input_names=["x"],
                              output_names=["y"], dynamic_shapes=({0: torch.export.Dim("batch")},), verbose=False)
        else:
            torch.onnx.export(model, (example,), f, dynamo=False, opset_version=opset, input_names=["x"],
                              output_names=["y"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return f.getvalue()


EXPORTS = [(False, 17), (False, 20), (True, 18), (True, 20)]  # (dynamo, opset): 17 and the newest of each
# a test per exporter and opset; the dynamo exports at opset 20 (the slowest cases, the same
# exporter as opset 18's) run in the slow run
each_exporter = pytest.mark.parametrize("dynamo,opset", [
    pytest.param(d, o, marks=pytest.mark.slow if (d, o) == (True, 20) else (),
                 id=f"{'dynamo' if d else 'torchscript'}-opset{o}") for d, o in EXPORTS])


@pytest.fixture(scope="module")
def cnn():
    torch.manual_seed(0)
    model = CNN().eval()
    with torch.no_grad():  # statistics that are not the identity, so the folded BN matters
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model


@each_exporter
def test_pytorch_cnn_export_runs_as_in_pytorch_and_onnx_runtime(cnn, dynamo, opset):
    x = torch.randn(3, 1, 16, 16)
    imported_as_in_pytorch_and_onnx_runtime(cnn, x, torch.randn(5, 1, 16, 16), dynamo, opset)


def imported_as_in_pytorch_and_onnx_runtime(model, example, batch, dynamo, opset):
    """Export `model` with `example`, load it in lamina; on `batch` (another batch size) lamina's
    output equals PyTorch's and ONNX Runtime's to 1e-4. Returns the imported network."""
    blob = export(model, example, dynamo, opset)
    net = lm.onnx.load(blob)
    ours = net.run({"x": batch.numpy()})["y"]
    with torch.no_grad():
        np.testing.assert_allclose(ours, model(batch).numpy(), rtol=1e-4, atol=1e-5)
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": batch.numpy()})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)
    return net


class Signal1d(torch.nn.Module):
    """1-D layers: Conv1d (strided, dilated, grouped), BatchNorm1d, PReLU (per channel and
    single), MaxPool1d, AvgPool1d, ConvTranspose1d, BatchNorm1d over features, Linear."""

    def __init__(self):
        super().__init__()
        self.c1 = torch.nn.Conv1d(2, 6, 5, stride=2, padding=2)
        self.bn = torch.nn.BatchNorm1d(6)
        self.act = torch.nn.PReLU(6)
        self.c2 = torch.nn.Conv1d(6, 6, 3, padding=2, dilation=2, groups=3)
        self.pool = torch.nn.MaxPool1d(2)
        self.avg = torch.nn.AvgPool1d(3, stride=1, padding=1, count_include_pad=False)
        self.up = torch.nn.ConvTranspose1d(6, 3, 4, stride=2, padding=1)
        self.fc = torch.nn.Linear(3 * 16, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.out = torch.nn.PReLU()

    def forward(self, x):
        x = self.pool(self.act(self.bn(self.c1(x))))
        x = self.up(self.avg(self.c2(x)))
        return self.out(self.norm(self.fc(torch.flatten(x, 1))))


@each_exporter
def test_pytorch_1d_signal_model_export(dynamo, opset):
    """1-D convolutions and pools run as 2-D ones of height 1, to the same numbers."""
    torch.manual_seed(5)
    model = Signal1d().eval()
    with torch.no_grad():
        for bn in (model.bn, model.norm):
            bn.running_mean.uniform_(-1, 1)
            bn.running_var.uniform_(0.5, 2)
        model.act.weight.uniform_(-0.5, 0.5)
    imported_as_in_pytorch_and_onnx_runtime(model, torch.randn(2, 2, 32), torch.randn(5, 2, 32), dynamo, opset)


class SqueezeExcite(torch.nn.Module):
    """A MobileNetV3-style block: Conv2d, Hardswish, squeeze-and-excitation (global average pool,
    1x1 convolutions, Hardsigmoid, a product broadcast over each channel's plane), a residual Add,
    tanh GELU, a spatial gate broadcast over the channels, Linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.squeeze = torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(1), torch.nn.Conv2d(8, 4, 1), torch.nn.ReLU(),
                                           torch.nn.Conv2d(4, 8, 1), torch.nn.Hardsigmoid())
        self.where = torch.nn.Conv2d(8, 1, 3, padding=1)
        self.fc = torch.nn.Linear(8 * 6 * 6, 5)

    def forward(self, x):
        h = torch.nn.functional.hardswish(self.conv(x))
        h = torch.nn.functional.gelu(h * self.squeeze(h) + h, approximate="tanh")
        h = h * torch.sigmoid(self.where(h))
        return self.fc(torch.flatten(h, 1))


@each_exporter
def test_pytorch_squeeze_excite_export(dynamo, opset):
    """Products of two values of different shapes broadcast (each channel's weight over its plane,
    one map over every channel), as in PyTorch and ONNX Runtime."""
    torch.manual_seed(6)
    model = SqueezeExcite().eval()
    net = imported_as_in_pytorch_and_onnx_runtime(model, torch.randn(2, 3, 6, 6), torch.randn(4, 3, 6, 6), dynamo,
                                                  opset)
    assert any(layer.kind == "broadcast" for layer in net.layers)


class Rearranging(torch.nn.Module):
    """Data moved within a sample: a softmax over the channels, two branches joined along the
    height, a permute of height and width, a log-softmax over the height."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Conv2d(2, 3, 3, padding=1), torch.nn.Conv2d(2, 3, 1)
        self.fc = torch.nn.Linear(3 * 10 * 4, 4)

    def forward(self, x):
        h = torch.cat([torch.softmax(self.a(x), dim=1), self.b(x)], dim=2)        # [N, 3, 10, 4]
        h = torch.log_softmax(h.permute(0, 1, 3, 2), dim=3)                          # [N, 3, 4, 10]
        return self.fc(torch.flatten(h, 1))


@each_exporter
def test_pytorch_model_moving_data_within_samples(dynamo, opset):
    """Softmax along a channel axis, Concat along the height, Transpose within a sample: lamina's
    Transpose layer moves the data, as PyTorch and ONNX Runtime do."""
    torch.manual_seed(12)
    model = Rearranging().eval()
    net = imported_as_in_pytorch_and_onnx_runtime(model, torch.randn(2, 2, 5, 4), torch.randn(3, 2, 5, 4), dynamo,
                                                  opset)
    assert any(layer.kind == "transpose" for layer in net.layers)


class SmoothActivations(torch.nn.Module):
    """Softplus (which the dynamo exporter writes as Where(x > 20, x, Softplus(x))), Mish and CELU
    (ONNX operators of their own in dynamo's export), over values past softplus's threshold."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 12)
        self.acts = torch.nn.ModuleList([torch.nn.Softplus(), torch.nn.Mish(), torch.nn.CELU(0.5)])

    def forward(self, x):
        h = self.fc(x) * 12
        return torch.cat([a(part) for a, part in zip(self.acts, h.split(4, dim=1))], dim=1)


@each_exporter
def test_pytorch_smooth_activations(dynamo, opset):
    torch.manual_seed(13)
    model = SmoothActivations().eval()
    net = imported_as_in_pytorch_and_onnx_runtime(model, torch.randn(2, 4), torch.randn(5, 4), dynamo, opset)
    kinds = [layer.activation for layer in net.layers if layer.kind == "activation"]
    assert kinds.count("softrelu") == 2 and "elu" in kinds  # softplus, once with mish; celu's elu


def test_softplus_with_a_low_threshold_is_not_fused():
    """Below PyTorch's threshold of 20, Softplus and its Where differ in float32: the subgraph is
    not taken for softplus, and runs node by node (Greater, Where), as in PyTorch."""
    torch.manual_seed(14)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Softplus(threshold=5)).eval()
    with torch.no_grad():
        model[0].weight.mul_(8)  # values on both sides of the threshold
    net = imported_as_in_pytorch_and_onnx_runtime(model, torch.randn(2, 4), torch.randn(6, 4), True, 18)
    assert "where" in {layer.kind for layer in net.layers}


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_fine_tuning_an_imported_cnn_follows_pytorch(dynamo):
    """Gradients of an imported model equal PyTorch's on the same batch, and 20 steps lower the loss."""
    torch.manual_seed(1)
    model = CNN(batch_norm=False).eval()
    net = lm.onnx.load(export(model, torch.randn(2, 1, 16, 16), dynamo, 18 if dynamo else 17))
    labels = net.input("labels", dtype="int32")
    net.outputs(loss=lm.layers.SoftmaxCrossEntropy()(net.values[net.output_values["y"]], labels))
    rng = np.random.default_rng(2)
    xb = rng.standard_normal((8, 1, 16, 16)).astype(np.float32)
    yb = rng.integers(0, 5, 8).astype(np.int32)
    net.forward({"x": xb, "labels": yb}, outputs=["loss"])
    net.backward()
    loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(xb)), torch.from_numpy(yb).long())
    loss.backward()
    ours = [p for p in net.parameters()]
    theirs = [p for p in model.parameters()]
    assert [tuple(p.shape) for p in ours] == [tuple(p.shape) for p in theirs]
    for p, q in zip(ours, theirs):
        np.testing.assert_allclose(p.grad, q.grad.numpy(), rtol=1e-4, atol=1e-6)
    opt = lm.optim.SGD(net, lr=0.05, momentum=0.9)
    feeds = {"x": xb, "labels": yb}
    first = net.train_step(feeds, opt)
    for _ in range(19):
        last = net.train_step(feeds, opt)
    assert last < 0.5 * first


def graph_model(nodes, inputs, outputs, initializers=()):
    from onnx import helper
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_every_unsupported_part_is_listed_at_once():
    from onnx import TensorProto, helper, numpy_helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])
    model = graph_model([
        helper.make_node("Shrink", ["x"], ["a"], name="shrink"),
        helper.make_node("Relu", ["a"], ["b"], name="relu"),  # fine, but its input is not: not reported
        helper.make_node("Gemm", ["b", "w"], ["c"], name="gemm_t", transA=1),
        helper.make_node("Concat", ["c", "c"], ["d"], name="cat0", axis=0),
        helper.make_node("Softmax", ["x"], ["y"], name="soft", axis=0),
    ], [x], [y], [numpy_helper.from_array(np.ones((4, 4), np.float32), "w")])
    with pytest.raises(lm.onnx.UnsupportedModelError) as info:
        lm.onnx.load(model.SerializeToString())
    message = str(info.value)
    assert "cannot run 2 part(s)" in message
    assert "node 'shrink' (Shrink): an operator lamina has no layer for" in message
    assert "node 'soft' (Softmax): axis 0 is the batch axis" in message
    # with the Shrink gone, the nodes behind it are built and checked too
    model.graph.node[0].op_type = "Tanh"
    del model.graph.node[3].attribute[:]
    model.graph.node[3].op_type = "Shrink"
    model.graph.node[3].input.pop()
    with pytest.raises(lm.onnx.UnsupportedModelError) as info:
        lm.onnx.load(model)
    problems = {(n, what.split(" (")[0]) for n, _, what in info.value.problems}
    # 'cat0', now a Shrink, reads the refused Gemm's output: its operator is still checked
    assert problems == {("gemm_t", "transA=1 with A from the inputs"), ("cat0", "an operator lamina has no layer for"),
                        ("soft", "axis 0 is the batch axis")}


def test_malformed_files_name_the_file(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"\x08\x07garbage that is no protobuf \xff\xff")
    with pytest.raises(lm.ModelFileError, match="bad.onnx: (not an ONNX model|the model fails onnx.checker)"):
        lm.onnx.load(bad)
    with pytest.raises(lm.ModelFileError, match="missing.onnx: cannot read"):
        lm.onnx.load(tmp_path / "missing.onnx")
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])
    broken = graph_model([helper.make_node("Relu", ["nowhere"], ["y"], name="r")], [x],
                         [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])])
    (tmp_path / "broken.onnx").write_bytes(broken.SerializeToString())
    with pytest.raises(lm.ModelFileError, match="broken.onnx: the model fails onnx.checker"):
        lm.onnx.load(tmp_path / "broken.onnx")


def test_the_command_takes_onnx_files(tmp_path, cnn, capsys):
    blob = export(cnn, torch.randn(2, 1, 16, 16), False, 17)
    (tmp_path / "cnn.onnx").write_bytes(blob)
    x = np.random.default_rng(3).standard_normal((4, 1, 16, 16)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x)
    assert main(["import", str(tmp_path / "cnn.onnx"), "-o", str(tmp_path / "cnn.lamina")]) == 0
    converted = lm.load(tmp_path / "cnn.lamina")
    with torch.no_grad():
        np.testing.assert_allclose(converted.run({"x": x})["y"], cnn(torch.from_numpy(x)).numpy(), rtol=1e-4,
                                   atol=1e-5)
    assert main(["infer", str(tmp_path / "cnn.onnx"), str(tmp_path / "in.npz"), "-o", str(tmp_path / "o.npz")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "o.npz")["y"], converted.run({"x": x})["y"])
    assert main(["inspect", str(tmp_path / "cnn.onnx")]) == 0
    shown = capsys.readouterr().out
    assert "Conv2d" in shown
    assert re.search(r"runs on cpu as forward: \w+, input grad: \w+, weight grad: \w+", shown), shown
    (tmp_path / "junk.onnx").write_bytes(b"junk")
    assert main(["import", str(tmp_path / "junk.onnx"), "-o", str(tmp_path / "j.lamina")]) == 2
    assert "junk.onnx:" in capsys.readouterr().err
    assert not (tmp_path / "j.lamina").exists()


# ---------------------------------------------------------------- export

def every_exportable_layer():
    """A network using each layer the exporter knows, in inference form."""
    lm.manual_seed(7)
    net = lm.Network()
    x = net.input("x", (3, 8, 8))
    ids = net.input("ids", dtype="int32")
    h = lm.layers.Conv2d(3, 4, 3, padding=1, stride=1)(x)
    bn = lm.layers.BatchNorm2d(4)
    h = bn(h)
    h = lm.layers.Activation("relu")(h)
    a = lm.layers.MaxPool2d(2)(h)                                # [4, 4, 4]
    b = lm.layers.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)(h)
    h = lm.layers.ConcatChannels()(a, b)                         # [8, 4, 4]
    up = lm.layers.ConvTranspose2d(8, 2, 3, stride=2, padding=1, output_padding=1)(h)  # [2, 8, 8]
    g = lm.layers.Conv2d(2, 2, 3, padding=2, dilation=2, groups=2)(up)
    flat = lm.layers.Reshape((128,))(lm.layers.Multiply()(lm.layers.Transpose((0, 2, 1))(up), g))
    flat = lm.layers.Dropout(0.3)(lm.layers.Scale(0.5)(flat))
    e = lm.layers.Embedding(11, 6)(ids)
    h = lm.layers.Linear([128, 6], 16, activation="tanh")(flat, e)
    h = lm.layers.Bias((16,))(lm.layers.Linear(16, 16, activation="leaky_relu", slope=0.2)(h))
    h = lm.layers.PReLU(16)(h)
    h = lm.layers.Multiply()(h, lm.layers.Broadcast((16,))(lm.layers.Linear(16, 1, activation="sigmoid")(h)))
    y = lm.layers.Linear(16, 5, activation="softmax")(lm.layers.Add(activation="sigmoid")(h, h))
    z = lm.layers.Activation("softrelu")(lm.layers.Linear(12, 4, bias=False)(lm.layers.Slice(2, 14)(h)))
    labels = net.input("labels", dtype="int32")
    net.outputs(probs=y, extra=z, loss=lm.layers.SoftmaxCrossEntropy()(y, labels))
    for p in (bn.params["running_mean"], bn.params["running_var"]):
        p.assign(np.linspace(0.5, 1.5, 4))
    net.layer("prelu0").params["weight"].assign(np.linspace(-0.3, 0.6, 16))
    return net


def test_export_runs_in_onnx_runtime_and_passes_the_full_check(tmp_path):
    net = every_exportable_layer()
    model = lm.onnx.save(net, tmp_path / "all.onnx")
    onnx.checker.check_model(onnx.load(tmp_path / "all.onnx"), full_check=True)
    assert [o.name for o in model.graph.output] == ["probs", "extra"]  # the loss needs labels: left out
    rng = np.random.default_rng(8)
    feeds = {"x": rng.standard_normal((4, 3, 8, 8)).astype(np.float32), "ids": rng.integers(0, 11, 4).astype(np.int32)}
    ours = net.run(feeds, ["probs", "extra"])
    session = ort.InferenceSession(str(tmp_path / "all.onnx"), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"x": feeds["x"], "ids": feeds["ids"].astype(np.int64)})
    for name, got in zip(("probs", "extra"), theirs):
        np.testing.assert_allclose(got, ours[name], rtol=1e-5, atol=1e-6, err_msg=name)
    again = lm.onnx.load(tmp_path / "all.onnx")  # and back: the same outputs
    back = again.run({"x": feeds["x"], "ids": feeds["ids"]})
    for name in ("probs", "extra"):
        np.testing.assert_allclose(back[name], ours[name], rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("kind", [a for a in lm.backends.base.ALL_ACTIVATIONS if a != "linear"])
def test_every_activation_exports_and_imports_back(kind, tmp_path):
    """Each activation as an ONNX node ONNX Runtime computes as lamina does (GELU needs opset 20,
    which the file then declares), and back into lamina as the same activation."""
    net = lm.Network()
    net.outputs(y=lm.layers.Activation(kind, slope=0.3)(net.input("x", (3, 4))))
    model = lm.onnx.save(net, tmp_path / "act.onnx")
    assert model.opset_import[0].version == (20 if kind.startswith("gelu") else 18)
    x = np.random.default_rng(4).standard_normal((5, 3, 4)).astype(np.float32) * 2
    ours = net.run({"x": x})["y"]
    theirs = ort.InferenceSession(str(tmp_path / "act.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-6)
    back = lm.onnx.load(tmp_path / "act.onnx")
    assert [layer.activation for layer in back.layers] == [kind]
    np.testing.assert_allclose(back.run({"x": x})["y"], ours, rtol=1e-6, atol=1e-7)


def test_padding_before_and_after_and_ceil_mode_export(tmp_path):
    """Convolutions and pools padded differently before and after an axis, pools in ceil_mode:
    ONNX Runtime computes what lamina does, and the file imports back."""
    lm.manual_seed(9)
    net = lm.Network()
    x = net.input("x", (2, 9, 8))
    h = lm.layers.Conv2d(2, 4, 3, stride=2, padding=((1, 0), (0, 2)))(x)            # [4, 4, 5]
    h = lm.layers.MaxPool2d(3, stride=2, padding=((1, 0), (0, 1)), ceil_mode=True)(h)
    h = lm.layers.ConvTranspose2d(4, 3, 3, stride=2, padding=((0, 1), (1, 0)), output_padding=1)(h)
    h = lm.layers.AvgPool2d(2, stride=2, ceil_mode=True, count_include_pad=False)(h)
    net.outputs(y=h)
    lm.onnx.save(net, tmp_path / "pads.onnx")
    X = np.random.default_rng(10).standard_normal((3, 2, 9, 8)).astype(np.float32)
    ours = net.run({"x": X})["y"]
    theirs = ort.InferenceSession(str(tmp_path / "pads.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": X})[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(lm.onnx.load(tmp_path / "pads.onnx").run({"x": X})["y"], ours, rtol=1e-6, atol=1e-6)


def test_shipped_denoiser_exports(tmp_path):
    from pathlib import Path
    from lamina.zoo import denoise
    net = lm.load(Path(__file__).resolve().parent.parent / "models/denoise3d/model.lamina")
    assert main(["export", str(Path(__file__).resolve().parent.parent / "models/denoise3d/model.lamina"),
                 "-o", str(tmp_path / "dn.onnx")]) == 0
    clean = denoise.shapes(2, np.random.default_rng(1))
    noisy = denoise.noisy_copy(clean, np.random.default_rng(2))
    ours = net.run({"noisy": noisy}, ["denoised"])["denoised"]
    theirs = ort.InferenceSession(str(tmp_path / "dn.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"noisy": noisy})[0]
    np.testing.assert_allclose(theirs, ours, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(lm.onnx.load(tmp_path / "dn.onnx").run({"noisy": noisy})["denoised"], ours,
                               rtol=1e-6, atol=1e-6)


def test_shipped_language_model_exports(tmp_path):
    """Embedding -> LSTM with initial states as inputs -> the selective layer in its full form
    (every column) -> the per-token score (a full-softmax cross-entropy that is not a training
    cost): ONNX Runtime, fed padded ids and next tokens with their lengths, gives lamina's scores
    and negative log-likelihoods on each sequence's steps and its last states; the file imports
    back with the same results; `--outputs` exports a part, whose inputs are what it needs."""
    from pathlib import Path
    model = Path(__file__).resolve().parent.parent / "models/python_lm/model.lamina"
    net = lm.load(model)
    assert main(["export", str(model), "-o", str(tmp_path / "lm.onnx")]) == 0
    rng = np.random.default_rng(3)
    lengths = [5, 9, 3]
    seqs, following = (lm.Sequences.from_list([rng.integers(0, 4096, n).astype(np.int32) for n in lengths])
                       for _ in range(2))
    h0, c0 = (0.3 * rng.standard_normal((3, 1, 256)).astype(np.float32) for _ in range(2))
    ours = net.run({"ids": seqs, "next": following, "h0": h0, "c0": c0}, ["logits", "nll", "last", "cell"])
    padded, _ = seqs.to_padded()
    session = ort.InferenceSession(str(tmp_path / "lm.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in session.get_inputs()) == ["c0", "h0", "ids", "lengths", "next"]
    feeds = {"ids": padded.astype(np.int64), "next": following.to_padded()[0].astype(np.int64),
             "lengths": np.array(lengths), "h0": h0, "c0": c0}
    logits, nll, last, cell = session.run(["logits", "nll", "last", "cell"], feeds)
    scores = ours["logits"].values.astype(np.float64)
    top = scores.max(1)
    reference = top + np.log(np.exp(scores - top[:, None]).sum(1)) - scores[np.arange(len(scores)), following.values]
    np.testing.assert_allclose(ours["nll"].values, reference, rtol=1e-5, atol=1e-5)
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(logits[i, :n], ours["logits"][i], rtol=1e-5, atol=2e-5)
        np.testing.assert_allclose(nll[i, :n], ours["nll"][i], rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(last, ours["last"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cell, ours["cell"], rtol=1e-5, atol=1e-5)
    back = lm.onnx.load(tmp_path / "lm.onnx")
    again = back.run(lm.onnx.feeds(back, feeds))
    np.testing.assert_allclose(again["logits"].values, ours["logits"].values, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(again["nll"].values, ours["nll"].values, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(again["cell"], ours["cell"], rtol=1e-6, atol=1e-6)
    assert main(["export", str(model), "-o", str(tmp_path / "state.onnx"), "--outputs", "last", "cell"]) == 0
    part = ort.InferenceSession(str(tmp_path / "state.onnx"), providers=["CPUExecutionProvider"])
    assert sorted(i.name for i in part.get_inputs()) == ["c0", "h0", "ids", "lengths"]
    assert [o.name for o in part.get_outputs()] == ["last", "cell"]
    np.testing.assert_allclose(part.run(["last"], {k: feeds[k] for k in ("ids", "lengths", "h0", "c0")})[0],
                               ours["last"], rtol=1e-5, atol=1e-5)
    with pytest.raises(lm.GraphError, match="output 'loss' is a training cost"):
        lm.onnx.save(net, outputs=["loss"])
    with pytest.raises(lm.GraphError, match="no output 'logit' to export; the network's outputs are 'loss', 'logits'"):
        lm.onnx.save(net, outputs=["logit"])


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_round_trip_pytorch_onnx_lamina_onnx(cnn, dynamo, tmp_path):
    blob = export(cnn, torch.randn(2, 1, 16, 16), dynamo, 18 if dynamo else 17)
    lm.onnx.save(lm.onnx.load(blob), tmp_path / "again.onnx")
    x = np.random.default_rng(4).standard_normal((3, 1, 16, 16)).astype(np.float32)
    first = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    second = ort.InferenceSession(str(tmp_path / "again.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(second, first, rtol=1e-5, atol=1e-5)


def test_layers_without_an_exporter_are_named():
    net = lm.Network()
    x = net.input("x", 3)
    net.outputs(y=lm.layers.SequenceSoftmax()(net.input("s", 1, sequence=True)), z=lm.layers.Activation("tanh")(x))
    with pytest.raises(lm.GraphError, match="no ONNX export yet for layer type SequenceSoftmax"):
        lm.onnx.save(net)
    sel = lm.Network()
    h, cols = sel.input("h", 4), sel.input("cols", dtype="selection")
    sel.outputs(scores=lm.layers.SelectiveLinear(4, 9)(h, cols))
    with pytest.raises(lm.GraphError, match="input 'cols': selection inputs have no ONNX export yet"):
        lm.onnx.save(sel)


class UNet3d(torch.nn.Module):
    """Conv3d, BatchNorm3d, ReLU, MaxPool3d, ConvTranspose3d and a skip Concat."""

    def __init__(self):
        super().__init__()
        block = lambda i, o: torch.nn.Sequential(torch.nn.Conv3d(i, o, 3, padding=1), torch.nn.BatchNorm3d(o),
                                                 torch.nn.ReLU())
        self.enc1, self.enc2 = block(1, 4), block(4, 8)
        self.pool = torch.nn.MaxPool3d(2)
        self.up = torch.nn.ConvTranspose3d(8, 4, 2, stride=2)
        self.dec = block(8, 4)
        self.out = torch.nn.Conv3d(4, 1, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        return self.out(self.dec(torch.cat([self.up(e2), e1], 1)))


@each_exporter
def test_pytorch_unet3d_export(dynamo, opset):
    torch.manual_seed(3)
    model = UNet3d().eval()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm3d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2)
    blob = export(model, torch.randn(2, 1, 8, 8, 8), dynamo, opset)
    net = lm.onnx.load(blob)
    x = torch.randn(3, 1, 8, 8, 8)
    ours = net.run({"x": x.numpy()})["y"]
    with torch.no_grad():
        np.testing.assert_allclose(ours, model(x).numpy(), rtol=1e-4, atol=1e-5)
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x.numpy()})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-4, atol=1e-5)


def test_the_docs_carry_the_current_conformance_table():
    from pathlib import Path
    page = (Path(__file__).resolve().parent.parent / "docs" / "onnx.md").read_text()
    assert onnx_conformance.table() in page, "regenerate it: python tests/onnx_conformance.py"


# ---------------------------------------------------------------- recurrent nodes on ragged sequences

ONNX_GATES = {"LSTM": (0, 3, 1, 2), "GRU": (1, 0, 2), "RNN": (0,)}  # PyTorch's blocks in ONNX's order


def onnx_recurrent_from_torch(module, op):
    """A one-node ONNX model of a PyTorch RNN/LSTM/GRU (time-major X [T, N, F], dynamic T and N)."""
    from onnx import TensorProto, helper, numpy_helper
    H, D = module.hidden_size, 2 if module.bidirectional else 1

    def blocks(a):
        parts = np.split(a, len(ONNX_GATES[op]))
        return np.concatenate([parts[g] for g in ONNX_GATES[op]])

    sfx = ["_l0", "_l0_reverse"][:D]
    get = lambda name: getattr(module, name).detach().numpy()
    w = np.stack([blocks(get("weight_ih" + s)) for s in sfx])
    r = np.stack([blocks(get("weight_hh" + s)) for s in sfx])
    b = np.stack([np.concatenate([blocks(get("bias_ih" + s)), blocks(get("bias_hh" + s))]) for s in sfx])
    attrs = dict(hidden_size=H, direction="bidirectional" if D == 2 else "forward")
    if op == "GRU":
        attrs["linear_before_reset"] = 1
    node = helper.make_node(op, ["X", "W", "R", "B"], ["Y", "Y_h"], name="rnn", **attrs)
    x = helper.make_tensor_value_info("X", TensorProto.FLOAT, ["T", "N", module.input_size])
    outs = [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["T", D, "N", H]),
            helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [D, "N", H])]
    inits = [numpy_helper.from_array(a.astype(np.float32), n) for a, n in ((w, "W"), (r, "R"), (b, "B"))]
    return graph_model([node], [x], outs, inits)


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("bidirectional", [False, True], ids=["forward", "bidirectional"])
def test_recurrent_nodes_on_ragged_sequences_follow_pytorch_packed(op, bidirectional):
    """ONNX's own cases never use ragged lengths: here each sequence of a ragged batch runs on
    its own length, against PyTorch on a PackedSequence."""
    torch.manual_seed(5)
    module = getattr(torch.nn, op)(3, 4, bidirectional=bidirectional)
    net = lm.onnx.load(onnx_recurrent_from_torch(module, op), sequences={"X": "TN"})
    lengths = [5, 2, 4, 1]
    rng = np.random.default_rng(6)
    seqs = lm.Sequences.from_list([rng.standard_normal((n, 3)).astype(np.float32) for n in lengths])
    out = net.run({"X": seqs})
    padded = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(seqs[i]) for i in range(4)])  # [T, N, F]
    packed = torch.nn.utils.rnn.pack_padded_sequence(padded, lengths, enforce_sorted=False)
    with torch.no_grad():
        y, h = module(packed)
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y)  # [T, N, D*H], zeros past each end
    h = h[0] if op == "LSTM" else h
    D = 2 if bidirectional else 1
    want_y = y.numpy().reshape(y.shape[0], 4, D, 4).transpose(0, 2, 1, 3)  # ONNX Y: [T, D, N, H]
    got_y = lm.onnx.to_onnx_layout(out["Y"], net.onnx_axes["Y"])
    np.testing.assert_allclose(got_y, want_y, rtol=1e-5, atol=1e-6)
    got_h = lm.onnx.to_onnx_layout(out["Y_h"], net.onnx_axes["Y_h"])
    np.testing.assert_allclose(got_h, h.numpy(), rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- PyTorch sequence models

class LanguageModel(torch.nn.Module):
    """Embedding -> 2-layer LSTM -> Linear over the vocabulary, batch first."""

    def __init__(self, vocab=50):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, 8)
        self.lstm = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True)
        self.fc = torch.nn.Linear(16, vocab)

    def forward(self, ids):
        return self.fc(self.lstm(self.emb(ids))[0])


def export_sequences(model, example, dynamo, opset):
    """ONNX bytes with the batch and time axes of input and output dynamic."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (example,), f, dynamo=True, opset_version=opset, input_names=["ids"],
                              output_names=["y"], verbose=False,
                              dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("time")},))
        else:
            torch.onnx.export(model, (example,), f, dynamo=False, opset_version=opset, input_names=["ids"],
                              output_names=["y"], dynamic_axes={"ids": {0: "batch", 1: "time"},
                                                                "y": {0: "batch", 1: "time"}})
    return f.getvalue()


@each_exporter
def test_pytorch_lstm_language_model_runs_on_packed_sequences(dynamo, opset):
    """The export feeds padded [batch, time] ids; lamina runs the same file on ragged sequences
    without padding, each giving what PyTorch gives for it alone; padded to the file's layout, a
    batch of equal lengths equals ONNX Runtime's output."""
    torch.manual_seed(8)
    model = LanguageModel().eval()
    blob = export_sequences(model, torch.randint(0, 50, (3, 7)), dynamo, opset)
    # (the dynamo exporter at opset 20 fixes the time axis at the example's 7: naming the
    # sequence input says what the axes are)
    net = lm.onnx.load(blob, sequences={"ids": "NT"})
    assert net.onnx_axes == {"ids": ("N", "T"), "y": ("N", "T", 0)}
    assert "bias" not in {layer.kind for layer in net.layers}  # MatMul + Add of the bias: one Linear
    lengths = [5, 3, 9, 1]
    seqs = [torch.randint(0, 50, (n,)) for n in lengths]
    out = net.run({"ids": lm.Sequences.from_list([s.numpy().astype(np.int32) for s in seqs])})["y"]
    with torch.no_grad():
        for i, s in enumerate(seqs):
            np.testing.assert_allclose(out[i], model(s[None])[0].numpy(), rtol=1e-4, atol=1e-5)
    ids = np.random.default_rng(9).integers(0, 50, (4, 7))
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"ids": ids})[0]
    ours = net.run({"ids": lm.Sequences.from_padded(ids.astype(np.int32), [7] * 4)})["y"]
    np.testing.assert_allclose(lm.onnx.to_onnx_layout(ours, net.onnx_axes["y"]), theirs, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind,options", [("LSTM", dict(num_layers=2, bidirectional=True)),
                                          ("GRU", dict(bidirectional=True)), ("GRU", dict(reverse=True)),
                                          ("GRU", dict(linear_before_reset=False, bidirectional=True, num_layers=2)),
                                          ("RNN", dict(nonlinearity="relu", num_layers=2))],
                         ids=["lstm-2-layer-bidir", "gru-bidir", "gru-reverse", "gru-reset-first-2-layer-bidir",
                              "rnn-relu-2-layer"])
def test_recurrent_networks_export_with_sequence_lengths(kind, options, tmp_path):
    """Sequence inputs leave as padded [batch, time] plus `lengths` (sequence_lens of every
    recurrent node); ONNX Runtime's outputs equal lamina's on each sequence's valid steps, and the
    last states; the file imports back into lamina with the same results."""
    lm.manual_seed(11)
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    outs = getattr(lm.layers, kind)(8, 6, **options)(lm.layers.Embedding(20, 8)(ids))
    width = 12 if options.get("bidirectional") else 6
    net.outputs(y=lm.layers.Linear(width, 5, activation="tanh")(outs[0]), last=outs[1])
    lm.onnx.save(net, tmp_path / "seq.onnx")
    lengths = [5, 2, 4, 1]
    rng = np.random.default_rng(12)
    seqs = lm.Sequences.from_list([rng.integers(0, 20, n).astype(np.int32) for n in lengths])
    ours = net.run({"ids": seqs})
    padded, _ = seqs.to_padded()
    session = ort.InferenceSession(str(tmp_path / "seq.onnx"), providers=["CPUExecutionProvider"])
    y, last = session.run(None, {"ids": padded.astype(np.int64), "lengths": np.array(lengths, np.int64)})
    for i, n in enumerate(lengths):
        np.testing.assert_allclose(y[i, :n], ours["y"][i], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(last, ours["last"], rtol=1e-5, atol=1e-6)
    back = lm.onnx.load(tmp_path / "seq.onnx").run({"ids": seqs})
    np.testing.assert_allclose(back["y"].values, ours["y"].values, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(back["last"], ours["last"], rtol=1e-5, atol=1e-6)


class GRUClassifier(torch.nn.Module):
    """Embedding -> bidirectional GRU over variable-length sequences -> Linear on both last
    states. `packed`: the sequences go through pack_padded_sequence (the TorchScript exporter
    writes their lengths as the GRU's sequence_lens; PyTorch 2.13's dynamo exporter cannot trace
    pack_padded_sequence at all, so its export runs the GRU unpacked). The padded outputs of
    every step are a second output."""

    def __init__(self, packed, vocab=40, classes=3):
        super().__init__()
        self.packed = packed
        self.emb = torch.nn.Embedding(vocab, 8)
        self.gru = torch.nn.GRU(8, 12, batch_first=True, bidirectional=True)
        self.fc = torch.nn.Linear(24, classes)

    def forward(self, ids, lengths=None, enforce_sorted=True):
        x = self.emb(ids)
        if self.packed:
            x = torch.nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=enforce_sorted)
        out, h = self.gru(x)
        if self.packed:
            out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)
        return self.fc(torch.cat([h[0], h[1]], dim=1)), out


def export_gru_classifier(model, dynamo, opset):
    ids, lengths = torch.randint(0, 40, (3, 7)), torch.tensor([7, 5, 2])
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(model, (ids,), f, dynamo=True, opset_version=opset, input_names=["ids"],
                              output_names=["y", "states"],
                              dynamic_shapes=({0: torch.export.Dim("batch"), 1: torch.export.Dim("time")},))
        else:
            torch.onnx.export(model, (ids, lengths), f, dynamo=False, opset_version=opset,
                              input_names=["ids", "lengths"], output_names=["y", "states"],
                              dynamic_axes={"ids": {0: "batch", 1: "time"}, "lengths": {0: "batch"},
                                            "y": {0: "batch"}, "states": {0: "batch", 1: "time"}})
    return f.getvalue()


@each_exporter
def test_pytorch_bidirectional_gru_classifier_on_variable_lengths(dynamo, opset):
    """lamina runs the export on ragged sequences in any order, each giving what PyTorch gives for
    it alone (class scores from both directions' last states, and every step's outputs); fed as
    ONNX Runtime is (padded, with the lengths input where the file has one), it equals ONNX
    Runtime."""
    torch.manual_seed(21)
    model = GRUClassifier(packed=not dynamo).eval()
    blob = export_gru_classifier(model, dynamo, opset)
    net = lm.onnx.load(blob, sequences={"ids": "NT"})  # (dynamo at opset 20 may fix the time axis)
    assert net.input_names == ["ids"] and net.onnx_lengths == ([] if dynamo else ["lengths"])
    lengths = [5, 3, 9, 1]
    seqs = [torch.randint(0, 40, (n,)) for n in lengths]
    out = net.run({"ids": lm.Sequences.from_list([s.numpy().astype(np.int32) for s in seqs])})
    with torch.no_grad():
        for i, s in enumerate(seqs):
            y, states = model(s[None], torch.tensor([len(s)]))
            np.testing.assert_allclose(out["y"][i], y[0].numpy(), rtol=1e-4, atol=1e-5)
            np.testing.assert_allclose(out["states"][i], states[0].numpy(), rtol=1e-4, atol=1e-5)
    rng = np.random.default_rng(22)
    ids = rng.integers(0, 40, (4, 7))
    feeds = {"ids": ids} if dynamo else {"ids": ids, "lengths": np.array([7, 6, 6, 2])}  # sorted, as packed
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, feeds)
    ours = net.run(lm.onnx.feeds(net, feeds))
    np.testing.assert_allclose(ours["y"], theirs[0], rtol=1e-4, atol=1e-5)
    if not dynamo:  # lengths that are not a batch's are refused, never read
        for bad in ([7, 6, -1, 2], [7, 6, 8, 2], [7, 6]):
            with pytest.raises(lm.InputError, match="input 'ids'"):
                lm.onnx.feeds(net, {"ids": ids, "lengths": np.array(bad)})
        with pytest.raises(lm.InputError, match="are not those of the Sequences"):
            lm.onnx.feeds(net, {"ids": lm.Sequences.from_padded(ids, [7, 6, 6, 2]), "lengths": np.array([7, 6, 6, 1])})
    np.testing.assert_allclose(lm.onnx.to_onnx_layout(ours["states"], net.onnx_axes["states"]), theirs[1],
                               rtol=1e-4, atol=1e-5)


def test_fine_tuning_an_imported_gru_classifier_follows_pytorch():
    """20 SGD steps on ragged batches in lamina (packed, no padding) and in PyTorch (packed,
    unsorted) from the same weights: the gradients then still equal PyTorch's on the same batch,
    and the loss fell."""
    torch.manual_seed(23)
    model = GRUClassifier(packed=True)
    net = lm.onnx.load(export_gru_classifier(model.eval(), False, 17))
    labels = net.input("labels", dtype="int32")
    net.outputs(loss=lm.layers.SoftmaxCrossEntropy()(net.values[net.output_values["y"]], labels))
    assert [tuple(p.shape) for p in net.parameters()] == [tuple(p.shape) for p in model.parameters()]
    rng = np.random.default_rng(24)
    batches = []
    for _ in range(2):
        lengths = rng.integers(1, 12, 6)
        batches.append(([rng.integers(0, 40, n).astype(np.int32) for n in lengths],
                        rng.integers(0, 3, 6).astype(np.int32)))
    opt = lm.optim.SGD(net, lr=0.5)
    torch_opt = torch.optim.SGD(model.parameters(), lr=0.5)

    def torch_loss(seqs, y):
        padded = torch.nn.utils.rnn.pad_sequence([torch.from_numpy(s).long() for s in seqs], batch_first=True)
        scores, _ = model(padded, torch.tensor([len(s) for s in seqs]), enforce_sorted=False)
        return torch.nn.functional.cross_entropy(scores, torch.from_numpy(y).long())

    losses = []
    for step in range(21):
        seqs, y = batches[step % len(batches)]
        feeds = {"ids": lm.Sequences.from_list(seqs), "labels": y}
        torch_opt.zero_grad()
        theirs = torch_loss(seqs, y)
        theirs.backward()
        if step < 20:
            losses.append(net.train_step(feeds, opt))
            np.testing.assert_allclose(losses[-1], theirs.item(), rtol=1e-4)
            torch_opt.step()
    net.forward(feeds, outputs=["loss"])
    net.backward()
    for p, q in zip(net.parameters(), model.parameters()):  # (the embedding's gradient is sparse)
        np.testing.assert_allclose(p.dense_grad(net.backend), q.grad.numpy(), rtol=1e-4, atol=1e-5)
    assert losses[-1] < 0.7 * losses[0]


class PerRowCrossEntropy(torch.nn.Module):
    def __init__(self, reduction="none"):
        super().__init__()
        self.fc, self.reduction = torch.nn.Linear(6, 5), reduction

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.fc(x), y, reduction=self.reduction)


def export_scored(model, x, y, dynamo, opset):
    """ONNX bytes of a model of (x, labels), the batch axis dynamic."""
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            batch = torch.export.Dim("batch")
            torch.onnx.export(model, (x, y), f, dynamo=True, opset_version=opset, input_names=["x", "y"],
                              output_names=["nll"], dynamic_shapes=({0: batch}, {0: batch}), verbose=False)
        else:
            torch.onnx.export(model, (x, y), f, dynamo=False, opset_version=opset, input_names=["x", "y"],
                              output_names=["nll"], dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}})
    return f.getvalue()


@each_exporter
def test_per_row_cross_entropy_imports_as_a_score(dynamo, opset):
    """PyTorch's cross_entropy(reduction='none') exports as SoftmaxCrossEntropyLoss (ignore_index
    -100): it imports as a score, equal to PyTorch's; a label of -100 is refused by row; a mean
    over the batch is refused by name."""
    torch.manual_seed(0)
    model = PerRowCrossEntropy().eval()
    x, y = torch.randn(4, 6), torch.tensor([0, 4, 2, 1])
    net = lm.onnx.load(export_scored(model, x, y, dynamo, opset))
    assert net.cost_outputs() == []
    rows = torch.randn(7, 6)
    labels = torch.tensor([3, 0, 1, 4, 4, 2, 0])
    got = net.run(lm.onnx.feeds(net, {"x": rows.numpy(), "y": labels.numpy()}))["nll"]
    np.testing.assert_allclose(got, model(rows, labels).detach().numpy(), rtol=1e-5, atol=1e-6)
    with pytest.raises(lm.InputError, match=r"labels \(input 1\) must lie in \[0, 5\), found -100 at row 1"):
        net.run(lm.onnx.feeds(net, {"x": x.numpy(), "y": np.array([0, -100, 1, 1])}))
    with pytest.raises(lm.onnx.UnsupportedModelError, match="reduction 'mean'"):
        lm.onnx.load(export_scored(PerRowCrossEntropy("mean").eval(), x, y, dynamo, opset))


def test_an_imported_classifier_on_the_last_state_exports_back(tmp_path):
    """A GRU classifier whose Linear reads h_n[-1] imports, exports (the Gather of the last
    layer's state takes a scalar index, which removes the axis), and runs in ONNX Runtime as
    lamina runs it."""
    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gru, self.out = torch.nn.GRU(8, 16, batch_first=True), torch.nn.Linear(16, 3)

        def forward(self, x):
            return self.out(self.gru(x)[1][-1])

    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Classifier().eval(), (torch.randn(2, 5, 8),), str(tmp_path / "clf.onnx"), dynamo=False,
                          input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "N", 1: "T"}})
    net = lm.onnx.load(tmp_path / "clf.onnx")
    lm.onnx.save(net, tmp_path / "back.onnx")
    x = np.random.default_rng(0).standard_normal((4, 6, 8)).astype(np.float32)
    mine = net.run(lm.onnx.feeds(net, {"x": x}))["y"]
    theirs = ort.InferenceSession(str(tmp_path / "back.onnx")).run(None, {"x": x, "lengths": np.full(4, 6)})[0]
    np.testing.assert_allclose(theirs, mine, rtol=0, atol=1e-5)
    assert theirs.shape == (4, 3)


def _sample_rate_model():
    """y = x @ W1 where the scalar input sr is 16000, else relu(x @ -W1): an If on a scalar
    input, as voice-activity detectors choose their branch by sample rate."""
    from onnx import TensorProto, helper, numpy_helper
    w1 = np.arange(12, dtype=np.float32).reshape(4, 3) / 10
    then_g = helper.make_graph([helper.make_node("MatMul", ["x", "w1"], ["y_then"])], "then", [],
                               [helper.make_tensor_value_info("y_then", TensorProto.FLOAT, None)])
    else_g = helper.make_graph([helper.make_node("MatMul", ["x", "w2"], ["y_else"]),
                                helper.make_node("Relu", ["y_else"], ["y_else2"])], "else", [],
                               [helper.make_tensor_value_info("y_else2", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.array(16000, np.int64))),
             helper.make_node("Equal", ["sr", "k"], ["is16k"]),
             helper.make_node("If", ["is16k"], ["y"], then_branch=then_g, else_branch=else_g)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                                           helper.make_tensor_value_info("sr", TensorProto.INT64, [])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
                              [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(-w1, "w2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w1


@pytest.mark.parametrize("rate", [16000, 8000])
def test_constants_at_import_choose_an_if_branch(rate):
    """lm.onnx.load(..., constants={"sr": rate}): the scalar input is no input of the network, the
    If's condition folds and its branch runs in its place, matching ONNX Runtime."""
    model, w1 = _sample_rate_model()
    net = lm.onnx.load(model, constants={"sr": rate})
    assert net.input_names == ["x"]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = session.run(None, {"x": x, "sr": np.array(rate, np.int64)})[0]
    np.testing.assert_allclose(net.run({"x": x})["y"], theirs, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(theirs, x @ w1 if rate == 16000 else np.maximum(x @ -w1, 0), rtol=1e-6, atol=1e-6)


def test_a_scalar_input_without_a_constant_is_refused_with_the_way_out():
    model, _ = _sample_rate_model()
    with pytest.raises(lm.UnsupportedModelError, match=r"'sr' \(input\): a scalar input .*constants=\{'sr': \.\.\.\}\), "
                                                       r"or lamina import --constant sr=VALUE"):
        lm.onnx.load(model)
    with pytest.raises(lm.ModelFileError, match=r"constants names 'rate', which is no input of the model"):
        lm.onnx.load(model, constants={"rate": 16000})
    with pytest.raises(lm.ModelFileError, match=r"constants\['sr'\] has shape \[2\]; the input is \[\]"):
        lm.onnx.load(model, constants={"sr": [16000, 8000]})


def test_lamina_import_takes_constants(tmp_path, capsys):
    """`lamina import MODEL --constant sr=16000 -o OUT`: the command line's way to constants=; a
    malformed or unknown constant is one clear line and exit status 2."""
    from lamina.cli import main
    model, w1 = _sample_rate_model()
    path = tmp_path / "vad.onnx"
    path.write_bytes(model.SerializeToString())
    assert main(["import", str(path), "--constant", "sr=8000", "-o", str(tmp_path / "vad.lamina")]) == 0
    net = lm.load(tmp_path / "vad.lamina")
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    np.testing.assert_allclose(net.run({"x": x})["y"], np.maximum(x @ -w1, 0), rtol=1e-6, atol=1e-6)
    for bad, said in (("sr", "--constant sr: expected NAME=VALUE"), ("sr=fast", "--constant sr=fast: expected"),
                      ("rate=1", "constants names 'rate', which is no input")):
        capsys.readouterr()
        assert main(["import", str(path), "--constant", bad, "-o", str(tmp_path / "x.lamina")]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "x.lamina").exists()


class IndexedPool(torch.nn.Module):
    """A convolution, then a max pool returning its positions (PyTorch's return_indices): the
    pooled values feed a head, the positions are an output."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 3, 3, padding=1)

    def forward(self, x):
        y, indices = torch.nn.functional.max_pool2d(self.conv(x), 3, 2, 1, return_indices=True)
        return torch.relu(y), indices


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_pytorch_return_indices_import_as_pytorchs_positions(dynamo, dynamic):
    """PyTorch's exports subtract each plane's first position (a kernel-1 MaxPool's Indices at
    the origin) from ONNX's Indices: lamina's return_indices, equal to ONNX Runtime's and PyTorch's
    at every batch size the export runs at; lamina's own export writes the same pattern."""
    torch.manual_seed(3)
    model = IndexedPool().eval()
    x = torch.randint(-2, 3, (3, 2, 9, 8)).float()  # ties among the maxima
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        extra = ({"dynamic_shapes": ({0: torch.export.Dim("batch")},)} if dynamo else
                 {"dynamic_axes": {"x": {0: "batch"}}}) if dynamic else {}
        torch.onnx.export(model, (x,), f, dynamo=dynamo, input_names=["x"], output_names=["y", "indices"], **extra)
    net = lm.onnx.load(f.getvalue())
    session = ort.InferenceSession(f.getvalue(), providers=["CPUExecutionProvider"])
    for batch in ((1, 3) if dynamic else (3,)):
        feeds = {"x": x[:batch].numpy()}
        ours, theirs, torchs = net.run(feeds), session.run(None, feeds), model(x[:batch])
        np.testing.assert_array_equal(ours["indices"], theirs[1])
        np.testing.assert_array_equal(ours["indices"], torchs[1].numpy())
        np.testing.assert_allclose(ours["y"], theirs[0], rtol=1e-5, atol=1e-6)
    again = ort.InferenceSession(lm.onnx.save(net).SerializeToString(), providers=["CPUExecutionProvider"])
    np.testing.assert_array_equal(again.run(None, {"x": x.numpy()})[1], net.run({"x": x.numpy()})["indices"])


def test_onnx_indices_used_otherwise_are_refused_by_node():
    """ONNX's Indices count over the whole batch: as a model output they load only where that
    agrees with lamina's count (a static batch of 1 with one channel), and any use but PyTorch's
    subtraction is refused by name; column-major Indices are refused."""
    from onnx import TensorProto, helper
    pool = dict(kernel_shape=[2, 2], strides=[2, 2])

    def model(batch, channels, nodes, outputs):
        x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, 4, 4])
        return graph_model(nodes, [x], [helper.make_tensor_value_info(n, t, [batch, channels, 2, 2])
                                        for n, t in outputs]).SerializeToString()

    one = model(1, 1, [helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", **pool)],
                [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)])
    X = np.random.default_rng(9).standard_normal((1, 1, 4, 4)).astype(np.float32)
    want = ort.InferenceSession(one, providers=["CPUExecutionProvider"]).run(None, {"x": X})[1]
    np.testing.assert_array_equal(lm.onnx.load(one).run({"x": X})["i"], want)
    for batch, channels in (("N", 1), (1, 3), (2, 1)):
        with pytest.raises(lm.UnsupportedModelError, match=r"node 'i' \(output\): MaxPool's Indices .*agree only "
                                                           r"for a static batch of 1 and one channel"):
            lm.onnx.load(model(batch, channels, [helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", **pool)],
                               [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)]))
    cast = model("N", 2, [helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", **pool),
                          helper.make_node("Cast", ["i"], ["f"], name="as_float", to=TensorProto.FLOAT),
                          helper.make_node("Add", ["y", "f"], ["z"], name="mixed")], [("z", TensorProto.FLOAT)])
    with pytest.raises(lm.UnsupportedModelError, match=r"node 'as_float' \(Cast\): a use of MaxPool's Indices other "
                                                       r"than PyTorch's"):
        lm.onnx.load(cast)
    column = model(1, 1, [helper.make_node("MaxPool", ["x"], ["y", "i"], name="pool", storage_order=1, **pool)],
                   [("y", TensorProto.FLOAT), ("i", TensorProto.INT64)])
    with pytest.raises(lm.UnsupportedModelError, match=r"node 'pool' \(MaxPool\): storage_order=1"):
        lm.onnx.load(column)
