"""The models users bring: small PyTorch models built from the blocks of the architectures people
export (torchvision's MobileNet-V2, ResNet, EfficientNet, SqueezeNet, ShuffleNet, the 3-D video
ResNets, LRASPP's and FCN's upsampling heads, a 3-D U-Net, ESPCN's pixel shuffle, a diffusion
U-Net's GroupNorm block, InstanceNorm over 1-D features, global max pooling, and recurrent classifiers and language
models), each exported by both of PyTorch's exporters, with the example
input's static shapes (what `torch.onnx.export(model, (x,), path)` writes) and with a dynamic
batch. Each loads, matches ONNX Runtime to 1e-4 of its output's scale, and fine-tunes."""
import io
import warnings
import zlib

import numpy as np
import pytest

import lamina as lm

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn, F = torch.nn, torch.nn.functional


class MobileNetV2Block(nn.Module):
    """A strided stem and an inverted residual: ReLU6, depthwise convolution, linear bottleneck."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 2, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU6(inplace=True))
        self.expand = nn.Sequential(nn.Conv2d(8, 32, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU6(inplace=True))
        self.depthwise = nn.Sequential(nn.Conv2d(32, 32, 3, 1, 1, groups=32, bias=False), nn.BatchNorm2d(32),
                                       nn.ReLU6(inplace=True))
        self.project = nn.Sequential(nn.Conv2d(32, 8, 1, bias=False), nn.BatchNorm2d(8))
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(8, 10))

    def forward(self, x):
        x = self.stem(x)
        x = x + self.project(self.depthwise(self.expand(x)))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, (1, 1)), 1))


class ResNetBlock(nn.Module):
    """ResNet's 7x7 stem, max pool and a basic block."""

    def __init__(self):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 7, 2, 3, bias=False), nn.BatchNorm2d(8)
        self.pool = nn.MaxPool2d(3, 2, 1)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.c3, self.b3 = nn.Conv2d(8, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)

    def forward(self, x):
        x = self.pool(F.relu(self.b1(self.c1(x))))
        x = F.relu(x + self.b3(self.c3(F.relu(self.b2(self.c2(x))))))
        return self.fc(torch.flatten(nn.AdaptiveAvgPool2d((1, 1))(x), 1))


class EfficientNetBlock(nn.Module):
    """SiLU and squeeze-excitation (a pooled branch multiplying the channels)."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv2d(3, 8, 3, 2, 1), nn.BatchNorm2d(8)
        self.se1, self.se2 = nn.Conv2d(8, 2, 1), nn.Conv2d(2, 8, 1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        x = F.silu(self.bn(self.c(x)))
        x = x * torch.sigmoid(self.se2(F.silu(self.se1(F.adaptive_avg_pool2d(x, 1)))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class SqueezeNetFire(nn.Module):
    """A ceil-mode max pool and a fire module (two expand branches concatenated)."""

    def __init__(self):
        super().__init__()
        self.c, self.pool = nn.Conv2d(3, 8, 3, 2), nn.MaxPool2d(3, 2, ceil_mode=True)
        self.squeeze, self.e1, self.e3 = nn.Conv2d(8, 4, 1), nn.Conv2d(4, 8, 1), nn.Conv2d(4, 8, 3, padding=1)
        self.classifier = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        x = F.relu(self.squeeze(self.pool(F.relu(self.c(x)))))
        x = torch.cat([F.relu(self.e1(x)), F.relu(self.e3(x))], 1)
        return torch.flatten(F.adaptive_avg_pool2d(F.relu(self.classifier(x)), (1, 1)), 1)


class ShuffleNetBlock(nn.Module):
    """ShuffleNet-V2's channel shuffle (a view over groups, transposed, viewed back: shape arithmetic
    on the channel count) and its split into halves."""

    def __init__(self):
        super().__init__()
        self.c, self.fc = nn.Conv2d(3, 8, 3, 1, 1), nn.Linear(8, 4)

    def forward(self, x):
        x = self.c(x)
        n, c, h, w = x.size()
        x = x.view(n, 2, c // 2, h, w).transpose(1, 2).contiguous().view(n, c, h, w)
        left, right = x.chunk(2, dim=1)
        return self.fc(torch.cat((left, F.relu(right)), dim=1).mean([2, 3]))


class VideoResNetStem(nn.Module):
    """r3d_18's stem: a 3-D convolution over (time, height, width), BatchNorm3d, pooled."""

    def __init__(self):
        super().__init__()
        self.c, self.bn = nn.Conv3d(3, 8, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.flatten(nn.AdaptiveAvgPool3d((1, 1, 1))(F.relu(self.bn(self.c(x)))), 1))


class SegmentationHead(nn.Module):
    """LRASPP's and FCN's ending: features at half resolution upsampled bilinearly back to the
    input's height and width (sizes read from the input's shape)."""

    def __init__(self):
        super().__init__()
        self.down, self.classes = nn.Conv2d(3, 8, 3, 2, 1), nn.Conv2d(8, 5, 1)

    def forward(self, x):
        y = self.classes(F.relu(self.down(x)))
        return F.interpolate(y, size=x.shape[-2:], mode="bilinear", align_corners=False)


class UNet3d(nn.Module):
    """A 3-D U-Net level: pooled, convolved, upsampled trilinearly (corners aligned) and
    concatenated with the skip connection; nearest upsampling of a side branch."""

    def __init__(self):
        super().__init__()
        self.enc, self.mid = nn.Conv3d(1, 4, 3, padding=1), nn.Conv3d(4, 4, 3, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="trilinear", align_corners=True)
        self.dec = nn.Conv3d(8, 2, 3, padding=1)

    def forward(self, x):
        skip = F.relu(self.enc(x))
        low = F.relu(self.mid(F.max_pool3d(skip, 2)))
        y = self.dec(torch.cat([skip, self.up(low)], 1))
        return y + F.interpolate(F.avg_pool3d(y, 2), scale_factor=2, mode="nearest")


class SuperResolution(nn.Module):
    """ESPCN's pixel shuffle (DepthToSpace, CRD) after a convolution, its inverse (pixel unshuffle),
    and a channel repeat (Tile)."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 12, 3, padding=1), nn.Conv2d(6, 3, 3, padding=1)
        self.shuffle, self.unshuffle = nn.PixelShuffle(2), nn.PixelUnshuffle(2)

    def forward(self, x):
        up = self.shuffle(torch.tanh(self.c1(x)))  # [N, 3, 2H, 2W]
        return self.c2(torch.cat([up, self.shuffle(self.unshuffle(up))], 1)) + x.repeat(1, 1, 2, 2)


class DiffusionBlock(nn.Module):
    """A diffusion U-Net's residual block: GroupNorm, SiLU, convolution, twice, with the skip
    (PyTorch exports GroupNorm as Reshape, InstanceNormalization, Reshape, Mul, Add)."""

    def __init__(self):
        super().__init__()
        self.n1, self.c1 = nn.GroupNorm(2, 8), nn.Conv2d(8, 8, 3, padding=1)
        self.n2, self.c2 = nn.GroupNorm(4, 8), nn.Conv2d(8, 8, 3, padding=1)
        self.stem, self.head = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 3, 1)
        with torch.no_grad():  # the norms' weights off their initial ones and zeros
            for n in (self.n1, self.n2):
                n.weight.uniform_(0.5, 1.5)
                n.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        h = self.stem(x)
        return self.head(h + self.c2(F.silu(self.n2(self.c1(F.silu(self.n1(h)))))))


class StyleTransfer1d(nn.Module):
    """InstanceNorm with its affine over 1-D features (audio, style transfer), and one without."""

    def __init__(self):
        super().__init__()
        self.c1, self.n1 = nn.Conv1d(4, 8, 5, padding=2), nn.InstanceNorm1d(8, affine=True)
        self.c2, self.n2 = nn.Conv1d(8, 8, 3, padding=1), nn.InstanceNorm1d(8)
        self.fc = nn.Linear(8, 3)
        with torch.no_grad():
            self.n1.weight.uniform_(0.5, 1.5)
            self.n1.bias.uniform_(-0.3, 0.3)

    def forward(self, x):
        h = F.relu(self.n2(self.c2(F.relu(self.n1(self.c1(x))))))
        return self.fc(h.mean(2))


class GlobalMaxPooled(nn.Module):
    """Global max pooling both ways PyTorch writes it (`amax` over the spatial axes: ReduceMax;
    adaptive max pooling to 1: GlobalMaxPool or MaxPool), and over a 1-D signal."""

    def __init__(self):
        super().__init__()
        self.c, self.fc = nn.Conv2d(3, 8, 3), nn.Linear(20, 4)
        self.c1 = nn.Conv1d(8, 4, 3)

    def forward(self, x):
        h = self.c(x)
        signal = self.c1(h.mean(2)).amax(2)
        return self.fc(torch.cat([h.amax((2, 3)), F.adaptive_max_pool2d(h, 1).flatten(1), signal], 1))


class LSTMClassifier(nn.Module):
    """Batch-first features through a 2-layer LSTM; the last step classified."""

    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(8, 16, num_layers=2, batch_first=True), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.lstm(x)[0][:, -1])


class GRUClassifier(nn.Module):
    """Time-major features through a bidirectional GRU; both directions' last states classified."""

    def __init__(self):
        super().__init__()
        self.gru, self.fc = nn.GRU(8, 16, bidirectional=True), nn.Linear(32, 4)

    def forward(self, x):
        h = self.gru(x)[1]
        return self.fc(torch.cat([h[0], h[1]], 1))


class LanguageModel(nn.Module):
    """Token ids [N, T] -> Embedding -> LSTM -> a score per step and word."""

    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.fc = nn.Embedding(30, 8), nn.LSTM(8, 16, batch_first=True), nn.Linear(16, 30)

    def forward(self, ids):
        return self.fc(self.lstm(self.emb(ids))[0])


class DilatedPooling(nn.Module):
    """Max pooling over dilated windows (taps two apart) between convolutions, as context
    modules of segmentation networks do."""

    def __init__(self):
        super().__init__()
        self.conv, self.pool, self.head = nn.Conv2d(3, 6, 3, padding=1), nn.MaxPool2d(3, 1, 1, dilation=2), nn.Conv2d(6, 4, 1)

    def forward(self, x):
        return self.head(self.pool(F.relu(self.conv(x))))


def _images(n):
    return torch.randn(n, 3, 32, 32)


# name -> (model class, example input of batch n, the batch axis of the input)
MODELS = {
    "mobilenet_v2": (MobileNetV2Block, _images, 0),
    "resnet": (ResNetBlock, _images, 0),
    "efficientnet": (EfficientNetBlock, _images, 0),
    "squeezenet": (SqueezeNetFire, _images, 0),
    "shufflenet": (ShuffleNetBlock, _images, 0),
    "r3d": (VideoResNetStem, lambda n: torch.randn(n, 3, 4, 16, 16), 0),
    "segmentation": (SegmentationHead, _images, 0),
    "unet3d": (UNet3d, lambda n: torch.randn(n, 1, 8, 8, 8), 0),
    "superres": (SuperResolution, lambda n: torch.randn(n, 3, 8, 8), 0),
    "lstm": (LSTMClassifier, lambda n: torch.randn(n, 6, 8), 0),
    "gru": (GRUClassifier, lambda n: torch.randn(6, n, 8), 1),
    "language_model": (LanguageModel, lambda n: torch.randint(0, 30, (n, 7)), 0),
    "diffusion_block": (DiffusionBlock, lambda n: torch.randn(n, 3, 8, 8), 0),
    "style_transfer_1d": (StyleTransfer1d, lambda n: torch.randn(n, 4, 12), 0),
    "global_max": (GlobalMaxPooled, lambda n: torch.randn(n, 3, 9, 9), 0),
    "dilated_pool": (DilatedPooling, lambda n: torch.randn(n, 3, 12, 11), 0),
}


def build(name):
    torch.manual_seed(zlib.crc32(name.encode()))  # (a seed of its own: adding a model changes no other)
    model = MODELS[name][0]().eval()
    with torch.no_grad():  # batch norm statistics that are not the identity, so folding them matters
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2)
    return model


def export(model, example, dynamo, batch_axis=None):
    """ONNX bytes from PyTorch's exporter; batch_axis None: the example's static shapes (the
    default), else that axis of the input dynamic."""
    f = io.BytesIO()
    kw = {}
    if batch_axis is not None:
        kw = ({"dynamic_shapes": ({batch_axis: torch.export.Dim("batch", min=1, max=64)},)} if dynamo else
              {"dynamic_axes": {"x": {batch_axis: "batch"}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (example,), f, dynamo=dynamo, input_names=["x"], verbose=False, **kw)
    return f.getvalue()


def run_like_onnx_runtime(net, blob, x):
    """lamina's output for the ONNX input x (in the model's layout), compared with ONNX Runtime's
    to 1e-4 of the output's largest magnitude."""
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    name = session.get_inputs()[0].name
    theirs = session.run(None, {name: x})[0]
    out = net.run(lm.onnx.feeds(net, {name: x}))
    (key, ours), = out.items()
    ours = lm.onnx.to_onnx_layout(ours, net.onnx_axes[key])
    assert ours.shape == theirs.shape
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-4 * max(float(np.abs(theirs).max()), 1e-3))
    return ours


# the dynamo exports with a dynamic batch are the slowest cases here: make test runs those of a
# CNN and the recurrent models (the batch first and second), the slow run every one
IN_MAKE_TEST = ("resnet", "lstm", "gru", "language_model")
CASES = [pytest.param(name, dynamo, shapes, id=f"{name}-{'dynamo' if dynamo else 'torchscript'}-{shapes}",
                      marks=pytest.mark.slow if dynamo and shapes == "dynamic" and name not in IN_MAKE_TEST else ())
         for name in MODELS for dynamo in (False, True) for shapes in ("static", "dynamic")]


@pytest.mark.parametrize("name,dynamo,shapes", CASES)
def test_exported_model_runs_as_in_onnx_runtime(name, dynamo, shapes):
    """Static exports run at their own shapes, dynamic ones at batch 1 and 3."""
    model = build(name)
    make, batch_axis = MODELS[name][1], MODELS[name][2]
    example = make(2)
    blob = export(model, example, dynamo, batch_axis if shapes == "dynamic" else None)
    net = lm.onnx.load(blob)
    for n in ((2,) if shapes == "static" else (1, 3)):
        x = example if n == 2 else make(n)
        ours = run_like_onnx_runtime(net, blob, x.numpy())
        with torch.no_grad():
            np.testing.assert_allclose(ours, model(x).numpy(), rtol=0, atol=1e-4 * float(np.abs(ours).max()))


@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_export_fine_tunes(name):
    """The static export (PyTorch's default exporter) with a loss attached trains: 5 Adam steps on
    one batch lower the loss (cross-entropy on class scores; squared error on maps, summed over
    thousands of values per sample, at a tenth of the step)."""
    model = build(name)
    make = MODELS[name][1]
    example = make(2)
    net = lm.onnx.load(export(model, example, dynamo=True))
    (out_name,) = net.output_values
    out = net.values[net.output_values[out_name]]
    rng = np.random.default_rng(5)
    feeds = lm.onnx.feeds(net, {net.input_names[0]: example.numpy()})
    if len(out.spec.shape) > 1:  # a map per sample (segmentation, volumes): squared error to a target
        target = net.input("target", out.spec.shape)
        net.outputs(loss=lm.layers.SquareError()(out, target))
        feeds["target"] = rng.standard_normal((2,) + out.spec.shape).astype(np.float32)
    else:  # class scores, per sample or per step
        labels = net.input("labels", dtype="int32", sequence=out.spec.sequence)
        net.outputs(loss=lm.layers.SoftmaxCrossEntropy()(out, labels))
        classes = out.spec.shape[-1]
        if out.spec.sequence:
            lengths = feeds[net.input_names[0]].lengths
            feeds["labels"] = lm.Sequences.from_list([rng.integers(0, classes, n).astype(np.int32) for n in lengths])
        else:
            feeds["labels"] = rng.integers(0, classes, 2).astype(np.int32)
    opt = lm.optim.Adam(net, lr=0.01 if len(out.spec.shape) == 1 or out.spec.sequence else 0.001)
    losses = [net.train_step(feeds, opt) for _ in range(5)]
    assert losses[-1] < losses[0], losses


def _damaged(model, rng, count):
    """(what was done, model) for `count` damaged copies of an exported model: a node dropped, an
    attribute set to an odd value, or a node's input rewired to another tensor (or none)."""
    import onnx
    made = 0
    while made < count:
        damaged = onnx.ModelProto()
        damaged.CopyFrom(model)
        i = int(rng.integers(len(damaged.graph.node)))
        node = damaged.graph.node[i]
        kind = ("drop", "attribute", "input")[int(rng.integers(3))]
        if kind == "drop":
            del damaged.graph.node[i]
        elif kind == "attribute" and node.attribute:
            a = node.attribute[int(rng.integers(len(node.attribute)))]
            if a.type == onnx.AttributeProto.INT:
                a.i = int(rng.choice([-1, 0, 2, 7, 2 ** 31 - 1]))
            elif a.type == onnx.AttributeProto.FLOAT:
                a.f = float(rng.choice([-1.0, 0.0, np.nan, 1e30]))
            elif a.type == onnx.AttributeProto.INTS and a.ints:
                a.ints[int(rng.integers(len(a.ints)))] = int(rng.choice([-1, 0, 3, 100]))
            elif a.type == onnx.AttributeProto.STRING:
                a.s = b"bogus"
            else:
                continue
        elif kind == "input" and len(node.input) > 1:
            tensors = [t for n in damaged.graph.node for t in n.output] + [""]
            node.input[int(rng.integers(len(node.input)))] = tensors[int(rng.integers(len(tensors)))]
        else:
            continue
        made += 1
        yield f"{kind} at node #{i} ({node.op_type})", damaged


@pytest.mark.parametrize("name", ["mobilenet_v2", "lstm"] + [pytest.param(name, marks=pytest.mark.slow) for name in
                                                             ("shufflenet", "segmentation", "gru", "language_model")])
def test_damaged_exports_are_refused_by_node(name):
    """Exports with a node dropped, an attribute changed or an input rewired either load or are
    refused with the importer's errors (every problem naming its node), never another exception."""
    import onnx
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    model, make = build(name), MODELS[name][1]
    for dynamo in (False, True):
        loads_or_is_refused_by_node(onnx.load_model_from_string(export(model, make(2), dynamo)), rng, 8)


def loads_or_is_refused_by_node(exported, rng, count):
    """`count` damaged copies of the model each load, or are refused with the importer's errors
    (every problem naming its node), never another exception."""
    from lamina.errors import ModelFileError, UnsupportedModelError
    for what, damaged in _damaged(exported, rng, count):
        try:
            lm.onnx.load(damaged)
        except ModelFileError:
            pass
        except UnsupportedModelError as e:
            assert e.problems and all(where for where, _, _ in e.problems), what


def test_shape_arithmetic_on_the_wrong_tensor_is_refused_by_node():
    """The TorchScript LSTM export computes its zero states' shapes (Shape, Gather, Unsqueeze,
    Concat): an Unsqueeze or Gather given a shape vector as its axes or indices is refused,
    naming the node, not a numpy error."""
    import onnx
    from lamina.errors import UnsupportedModelError
    exported = onnx.load_model_from_string(export(build("lstm"), MODELS["lstm"][1](2), dynamo=False))
    shape_of = next(n.output[0] for n in exported.graph.node if n.op_type == "Shape")
    targets = [i for i, n in enumerate(exported.graph.node) if n.op_type in ("Unsqueeze", "Gather") and
               len(n.input) == 2 and any(m.op_type == "Shape" for m in exported.graph.node)]
    assert targets
    for i in targets:
        damaged = onnx.ModelProto()
        damaged.CopyFrom(exported)
        damaged.graph.node[i].input[1] = shape_of
        with pytest.raises(UnsupportedModelError) as refusal:
            lm.onnx.load(damaged)
        assert all(where for where, _, _ in refusal.value.problems)


CONSTANT_LENGTHS = [([5, 5, 5], "forward", None), ([5, 3, 1], "forward", None), ([2, 5, 4], "bidirectional", None),
                    ([5, 0, 5], "forward", r"constant sequence_lens \[5, 0, 5\]: expected one length from 1 to"),
                    ([5, 6, 5], "forward", r"constant sequence_lens \[5, 6, 5\]"),
                    ([5, 5], "forward", r"per sequence of the fixed batch \(3\)")]


@pytest.mark.parametrize("lengths,direction,refusal", CONSTANT_LENGTHS,
                         ids=["whole", "ragged", "ragged-bidirectional", "empty", "too-long", "wrong-batch"])
def test_constant_sequence_lengths(lengths, direction, refusal):
    """An LSTM node whose sequence_lens is a constant (its batch and time sizes fixed): those are
    the lengths of the Sequences lm.onnx.feeds makes from the padded input, and the model runs
    as in ONNX Runtime (Y zeros past each length, Y_h each sequence's last step); lengths out of
    range, or not one per sequence of the batch, are refused by name. Sequences of other lengths
    fed by hand are an InputError."""
    from onnx import TensorProto, helper, numpy_helper
    from lamina.errors import InputError, UnsupportedModelError
    T_, N_, C_, H_ = 5, 3, 4, 6
    D_ = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(a.astype(np.float32), name) for a, name in
             ((rng.standard_normal((D_, 4 * H_, C_)), "W"), (rng.standard_normal((D_, 4 * H_, H_)), "R"),
              (rng.standard_normal((D_, 8 * H_)), "B"))]
    inits.append(numpy_helper.from_array(np.array(lengths, np.int32), "lens"))
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "lens"], ["Y", "Y_h"], hidden_size=H_, name="lstm",
                            direction=direction)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T_, N_, C_])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [T_, D_, N_, H_]),
                               helper.make_tensor_value_info("Y_h", TensorProto.FLOAT, [D_, N_, H_])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    if refusal:
        with pytest.raises(UnsupportedModelError, match="lstm.*" + refusal):
            lm.onnx.load(model)
        return
    net = lm.onnx.load(model)
    x = rng.standard_normal((T_, N_, C_)).astype(np.float32)
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"X": x})
    out = net.run(lm.onnx.feeds(net, {"X": x}))
    for name, want in zip(("Y", "Y_h"), theirs):
        ours = lm.onnx.to_onnx_layout(out[name], net.onnx_axes[name])
        np.testing.assert_allclose(ours[:want.shape[0]], want, rtol=1e-5, atol=1e-6, err_msg=name)
    if lengths != [5, 5, 5]:
        with pytest.raises(InputError, match=r"the lengths fed \(\[\d, \d, \d\]\) are not those of the Sequences"):
            lm.onnx.feeds(net, {"X": lm.Sequences.from_padded(np.transpose(x, (1, 0, 2)), [5, 5, 5])})


class StatefulLSTM(nn.Module):
    """A recurrent stack fed its initial states as inputs [layers·directions, N, H] and returning
    its last ones (a streaming model's step: a voice-activity detector's state between chunks)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(4, 5, num_layers=2, batch_first=True), nn.Linear(5, 3)

    def forward(self, x, h, c):
        y, (h, c) = self.rnn(x, (h, c))
        return self.fc(y), h, c


class StatefulGRU(nn.Module):
    """The same with a bidirectional GRU (one state input)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(4, 5, bidirectional=True, batch_first=True), nn.Linear(10, 3)

    def forward(self, x, h):
        y, h = self.rnn(x, h)
        return self.fc(y), h


STATEFUL = [(kind, dynamo, shapes) for kind in ("lstm", "gru") for dynamo in (False, True)
            for shapes in ("static", "dynamic")]


@pytest.mark.parametrize("kind,dynamo,shapes", STATEFUL,
                         ids=[f"{k}-{'dynamo' if d else 'torchscript'}-{s}" for k, d, s in STATEFUL])
def test_initial_states_fed_as_inputs_batch_second(kind, dynamo, shapes):
    """Initial states [D, N, H] are inputs whose batch axis is their second: lamina takes them
    per sample ((D, H), `net.onnx_axes` (0, 'N', 1)), `lm.onnx.feeds` moves their batch axis
    first, and every output matches ONNX Runtime's."""
    torch.manual_seed(21)
    model = (StatefulLSTM if kind == "lstm" else StatefulGRU)().eval()
    names = ["x", "h", "c"] if kind == "lstm" else ["x", "h"]
    layers = 2

    def example(n):
        return (torch.randn(n, 6, 4),) + tuple(torch.randn(layers, n, 5) for _ in names[1:])
    f = io.BytesIO()
    kw = {}
    if shapes == "dynamic":
        kw = ({"dynamic_shapes": ({0: torch.export.Dim("batch", max=64)},) + tuple({1: torch.export.Dim("batch", max=64)}
                                                                                 for _ in names[1:])} if dynamo else
              {"dynamic_axes": {"x": {0: "batch"}, **{n: {1: "batch"} for n in names[1:]}}})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example(2), f, dynamo=dynamo, input_names=names, verbose=False, **kw)
    blob = f.getvalue()
    net = lm.onnx.load(blob)
    assert all(net.onnx_axes[n] == (0, "N", 1) for n in names[1:]) and not net.dynamic_axes
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    for n in ((2,) if shapes == "static" else (1, 3)):
        every_output_as_in_onnx_runtime(net, session, model, {k: v.numpy() for k, v in zip(names, example(n))})


def every_output_as_in_onnx_runtime(net, session, model, arrays, lengths=None):
    """Each of the model's outputs from lamina (fed through lm.onnx.feeds, answered in the ONNX
    layout) equals ONNX Runtime's and PyTorch's to 1e-5; with `lengths`, sequence outputs within
    each sequence's length (past it lamina has no steps: zeros in the padded layout)."""
    theirs = session.run(None, arrays)
    ours = net.run(lm.onnx.feeds(net, arrays))
    with torch.no_grad():
        torch_out = model(*(torch.from_numpy(a) for a in arrays.values()))
    for o, want, pt in zip(session.get_outputs(), theirs, torch_out):
        got, pt = lm.onnx.to_onnx_layout(ours[o.name], net.onnx_axes[o.name]), pt.numpy()
        if lengths is not None and "T" in net.onnx_axes[o.name]:
            keep = np.arange(got.shape[1])[None, :] < np.array(lengths)[:, None]
            got, want, pt = got[keep], want[keep], pt[keep]
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
        np.testing.assert_allclose(got, pt, rtol=0, atol=1e-5)


class UnsortedLSTM(nn.Module):
    """pack_padded_sequence(enforce_sorted=False): PyTorch sorts the batch by length (TopK,
    Gather), runs the LSTM and puts the outputs back in the batch's order (ScatterElements of a
    Range, Gather)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(4, 5, num_layers=2, batch_first=True), nn.Linear(5, 3)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, (h, _) = self.rnn(packed)
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.fc(y), self.fc(h[-1])


class UnsortedGRU(nn.Module):
    """The same with a bidirectional GRU given its initial state (which PyTorch sorts too)."""

    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(4, 5, bidirectional=True, batch_first=True), nn.Linear(10, 3)

    def forward(self, x, lengths, h0):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, h = self.rnn(packed, h0)
        y, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.fc(y), h


@pytest.mark.parametrize("kind", ["lstm", "gru"])
def test_unsorted_packed_sequences(kind):
    """The TorchScript export (the dynamo exporter cannot export pack_padded_sequence) loads, the
    sort and its inverse cancelling; outputs match ONNX Runtime and PyTorch within each sequence's
    length (past it lamina has no steps: zeros in the padded layout)."""
    torch.manual_seed(22)
    model = (UnsortedLSTM if kind == "lstm" else UnsortedGRU)().eval()
    names = ["x", "lengths"] + (["h0"] if kind == "gru" else [])

    def example(lengths):
        n = len(lengths)
        return (torch.randn(n, 6, 4), torch.tensor(lengths)) + ((torch.randn(2, n, 5),) if kind == "gru" else ())
    axes = {"x": {0: "batch", 1: "time"}, "lengths": {0: "batch"}, "h0": {1: "batch"}}
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, example([4, 6, 2]), f, dynamo=False, input_names=names,
                          dynamic_axes={n: axes[n] for n in names})
    blob = f.getvalue()
    net = lm.onnx.load(blob)
    assert net.onnx_lengths == ["lengths"]
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    for lengths in ([4, 6, 2], [1, 3, 6, 5, 2]):
        every_output_as_in_onnx_runtime(net, session, model, {k: v.numpy() for k, v in zip(names, example(lengths))},
                                        lengths)


def test_rows_left_in_the_order_by_length_are_refused():
    """Rows that stay in the order by length (the LSTM's output before it is put back) are refused
    where they leave the graph or meet rows in the batch's own order, not answered in the wrong
    order."""
    import onnx
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(UnsortedLSTM().eval(), (torch.randn(3, 6, 4), torch.tensor([4, 6, 2])), f, dynamo=False,
                          input_names=["x", "lengths"], dynamic_axes={"x": {0: "b", 1: "t"}, "lengths": {0: "b"}})
    model = onnx.load_from_string(f.getvalue())
    inverse = next(n.output[0] for n in model.graph.node if n.op_type == "ScatterElements")
    restore = next(n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == inverse
                   and n.attribute[0].i == 0)
    still_sorted = restore.input[0]
    leaving = onnx.ModelProto()
    leaving.CopyFrom(model)
    leaving.graph.output.append(onnx.helper.make_tensor_value_info(still_sorted, onnx.TensorProto.FLOAT,
                                                                         ["b", "t", 5]))
    with pytest.raises(lm.onnx.UnsupportedModelError, match="rows left in the batch's order by length"):
        lm.onnx.load(leaving)
    mixing = onnx.ModelProto()
    mixing.CopyFrom(model)
    mixing.graph.node.append(onnx.helper.make_node("Add", [still_sorted, restore.output[0]], ["mixed"], name="mix"))
    mixing.graph.output.append(onnx.helper.make_tensor_value_info("mixed", onnx.TensorProto.FLOAT, ["b", "t", 5]))
    with pytest.raises(lm.onnx.UnsupportedModelError, match="node 'mix' .*mixes rows in the batch's order by length"):
        lm.onnx.load(mixing)


@pytest.mark.parametrize("direction", ["forward", "bidirectional"])
@pytest.mark.parametrize("attrs", [dict(peep=True), dict(clip=0.6), dict(peep=True, clip=0.9)],
                         ids=["peepholes", "clip", "peepholes-clip"])
def test_lstm_peepholes_and_clip_run_as_in_onnx_runtime(attrs, direction):
    """An LSTM node with P (ONNX's rows i, o, f) and clip, lengths in sequence_lens and initial
    states as inputs: lamina's run equals ONNX Runtime's, and so does lamina's own export of it."""
    from onnx import TensorProto, helper, numpy_helper
    T_, N_, C_, H_ = 6, 4, 3, 5
    D_ = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(4)
    weights = {"W": rng.standard_normal((D_, 4 * H_, C_)), "R": rng.standard_normal((D_, 4 * H_, H_)),
               "B": rng.standard_normal((D_, 8 * H_))}
    if attrs.get("peep"):
        weights["P"] = rng.standard_normal((D_, 3 * H_))
    inits = [numpy_helper.from_array(a.astype(np.float32), name) for name, a in weights.items()]
    node = helper.make_node("LSTM", ["X", "W", "R", "B", "lens", "h0", "c0", "P" if "P" in weights else ""],
                            ["Y", "Y_h", "Y_c"], hidden_size=H_, name="lstm", direction=direction,
                            **({"clip": attrs["clip"]} if "clip" in attrs else {}))
    io = [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T_, "N", C_]),
          helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"]),
          helper.make_tensor_value_info("h0", TensorProto.FLOAT, [D_, "N", H_]),
          helper.make_tensor_value_info("c0", TensorProto.FLOAT, [D_, "N", H_])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in
            (("Y", [T_, D_, "N", H_]), ("Y_h", [D_, "N", H_]), ("Y_c", [D_, "N", H_]))]
    model = helper.make_model(helper.make_graph([node], "g", io, outs, inits),
                              opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"X": 2 * rng.standard_normal((T_, N_, C_)).astype(np.float32),
             "lens": np.array([6, 3, 1, 6], np.int32),
             "h0": rng.standard_normal((D_, N_, H_)).astype(np.float32),
             "c0": rng.standard_normal((D_, N_, H_)).astype(np.float32)}
    theirs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    net = lm.onnx.load(model)
    out = net.run(lm.onnx.feeds(net, feeds))
    for name, want in zip(("Y", "Y_h", "Y_c"), theirs):
        np.testing.assert_allclose(lm.onnx.to_onnx_layout(out[name], net.onnx_axes[name]), want, rtol=1e-4,
                                   atol=1e-5, err_msg=name)
    exported = lm.onnx.save(net).SerializeToString()
    session = ort.InferenceSession(exported, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    ours = net.run(lm.onnx.feeds(net, feeds))
    again = session.run(None, {n: v for n, v in {"X": np.ascontiguousarray(np.transpose(feeds["X"], (1, 0, 2))),
                                                 "lengths": feeds["lens"].astype(np.int64),
                                                 "h0": np.ascontiguousarray(np.transpose(feeds["h0"], (1, 0, 2))),
                                                 "c0": np.ascontiguousarray(np.transpose(feeds["c0"], (1, 0, 2)))
                                                 }.items() if n in names})
    np.testing.assert_allclose(again[1], ours["Y_h"], rtol=1e-4, atol=1e-5)
