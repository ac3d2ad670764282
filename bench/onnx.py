"""Suite `onnx`: the same .onnx files run by lamina (lm.onnx.load) and by ONNX Runtime, same
inputs, same thread count, inference: an LSTM language model (Embedding 4096x128 -> 2-layer
LSTM(256) -> Linear 4096) on 64 sequences of lengths 10..50 (lamina packed, ONNX Runtime padded
to 50: the file has no sequence_lens), a bidirectional GRU classifier (Embedding 4096x128 ->
packed bidirectional GRU(256) -> Linear 10 on both last states) on the same lengths (ONNX
Runtime padded, with the file's sequence_lens), a 2-D CNN (Conv2d, ReLU, MaxPool2d, Flatten,
Linear) and a 3-D U-Net (Conv3d, BatchNorm3d, ReLU, MaxPool3d, ConvTranspose3d, skip Concat),
exported by PyTorch's TorchScript exporter. "lamina-native" is the same network built with
lamina's layers (what the import should cost nothing against).

MobileNet-V2 and ResNet-18 (torchvision's architectures, written out here with random weights) on
224 x 224 images at batch 1 and 32, exported as a user does: PyTorch's default exporter (dynamo)
with the example input's static shapes, one file per batch size.

The two recurrent models run quantized too ("... int8" cases): the file as ONNX Runtime's
`quantize_dynamic` writes it (int8 weights, DynamicQuantizeLinear + MatMulInteger,
DynamicQuantizeLSTM), loaded by lamina as an int8 network and run by ONNX Runtime itself.

The files are written once into build/bench/onnx/ by the parent (PyTorch needed), then every
worker reads them.
"""
import os

import numpy as np

from .harness import ROOT

FOLDER = os.path.join(ROOT, "build", "bench", "onnx")
CASES = {
    # name: (input shape, multiply-adds per sample, for GFLOP/s)
    "lstm_lm": ((64, 50), None),
    "gru_classifier": ((64, 50), None),
    "cnn": ((64, 1, 28, 28), None),
    "unet3d": ((4, 1, 24, 24, 24), None),
    "mobilenet_v2_b1": ((1, 3, 224, 224), None),
    "mobilenet_v2_b32": ((32, 3, 224, 224), None),
    "resnet18_b1": ((1, 3, 224, 224), None),
    "resnet18_b32": ((32, 3, 224, 224), None),
}
STATIC = ("mobilenet_v2_b1", "mobilenet_v2_b32", "resnet18_b1", "resnet18_b32")  # dynamo, static shapes
LM_LENGTHS = np.random.default_rng(1).integers(10, 51, 64)
QUANTIZED = ("lstm_lm", "gru_classifier")  # also written by onnxruntime's quantize_dynamic, as <name>_int8.onnx


def _models():
    import torch

    class CNN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(1, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Conv2d(32, 64, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
                torch.nn.Flatten(), torch.nn.Linear(64 * 7 * 7, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))

        def forward(self, x):
            return self.body(x)

    class UNet3d(torch.nn.Module):
        def __init__(self):
            super().__init__()
            block = lambda i, o: torch.nn.Sequential(torch.nn.Conv3d(i, o, 3, padding=1), torch.nn.BatchNorm3d(o),
                                                     torch.nn.ReLU())
            self.enc1, self.enc2 = block(1, 16), block(16, 32)
            self.pool = torch.nn.MaxPool3d(2)
            self.up = torch.nn.ConvTranspose3d(32, 16, 2, stride=2)
            self.dec = block(32, 16)
            self.out = torch.nn.Conv3d(16, 1, 1)

        def forward(self, x):
            e1 = self.enc1(x)
            return self.out(self.dec(torch.cat([self.up(self.enc2(self.pool(e1))), e1], 1)))

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4096, 128)
            self.lstm = torch.nn.LSTM(128, 256, num_layers=2, batch_first=True)
            self.fc = torch.nn.Linear(256, 4096)

        def forward(self, ids):
            return self.fc(self.lstm(self.emb(ids))[0])

    class GRUClassifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(4096, 128)
            self.gru = torch.nn.GRU(128, 256, batch_first=True, bidirectional=True)
            self.fc = torch.nn.Linear(512, 10)

        def forward(self, ids, lengths):
            packed = torch.nn.utils.rnn.pack_padded_sequence(self.emb(ids), lengths, batch_first=True)
            out, h = self.gru(packed)
            out, _ = torch.nn.utils.rnn.pad_packed_sequence(out, batch_first=True)  # (the exporter needs the pair)
            return self.fc(torch.cat([h[0], h[1]], dim=1)), out

    vision = _vision_models(torch)
    return {"lstm_lm": LanguageModel, "gru_classifier": GRUClassifier, "cnn": CNN, "unet3d": UNet3d,
            **{name: vision[name.rsplit("_b", 1)[0]] for name in STATIC}}


def _vision_models(torch):
    """torchvision's MobileNet-V2 and ResNet-18, layer for layer (torchvision is not a
    dependency of the bench)."""
    nn = torch.nn

    def conv_bn(cin, cout, k, stride=1, groups=1, relu6=True):
        layers = [nn.Conv2d(cin, cout, k, stride, (k - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return nn.Sequential(*layers, nn.ReLU6(inplace=True)) if relu6 else nn.Sequential(*layers)

    class InvertedResidual(nn.Module):
        def __init__(self, cin, cout, stride, expand):
            super().__init__()
            hidden = cin * expand
            layers = ([conv_bn(cin, hidden, 1)] if expand != 1 else []) + [
                conv_bn(hidden, hidden, 3, stride, groups=hidden), conv_bn(hidden, cout, 1, relu6=False)]
            self.body, self.residual = nn.Sequential(*layers), stride == 1 and cin == cout

        def forward(self, x):
            return x + self.body(x) if self.residual else self.body(x)

    class MobileNetV2(nn.Module):
        def __init__(self):
            super().__init__()
            layers, cin = [conv_bn(3, 32, 3, 2)], 32
            for t, c, n, s in ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1),
                               (6, 160, 3, 2), (6, 320, 1, 1)):
                for i in range(n):
                    layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                    cin = c
            self.features = nn.Sequential(*layers, conv_bn(cin, 1280, 1))
            self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(1280, 1000))

        def forward(self, x):
            return self.classifier(torch.flatten(nn.functional.adaptive_avg_pool2d(self.features(x), 1), 1))

    class BasicBlock(nn.Module):
        def __init__(self, cin, cout, stride):
            super().__init__()
            self.c1, self.b1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
            self.c2, self.b2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.b2(self.c2(torch.relu(self.b1(self.c1(x))))) + self.down(x))

    class ResNet18(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                                      nn.MaxPool2d(3, 2, 1))
            blocks, cin = [], 64
            for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
                blocks += [BasicBlock(cin, cout, stride), BasicBlock(cout, cout, 1)]
                cin = cout
            self.blocks, self.fc = nn.Sequential(*blocks), nn.Linear(512, 1000)

        def forward(self, x):
            return self.fc(torch.flatten(nn.functional.adaptive_avg_pool2d(self.blocks(self.stem(x)), 1), 1))

    return {"mobilenet_v2": MobileNetV2, "resnet18": ResNet18}


def native(name):
    """The case's network built with lamina's layers (its weights do not matter for speed)."""
    import lamina as lm
    L = lm.layers
    net = lm.Network()
    if name in ("lstm_lm", "gru_classifier"):
        x = L.Embedding(4096, 128)(net.input("x", dtype="int32", sequence=True))
        if name == "lstm_lm":
            net.outputs(y=L.Linear(256, 4096)(L.LSTM(128, 256, num_layers=2)(x)[0]))
        else:
            last = L.GRU(128, 256, bidirectional=True)(x)[1]
            net.outputs(y=L.Linear(512, 10)(L.Reshape((512,))(last)))
    elif name == "cnn":
        x = net.input("x", (1, 28, 28))
        for cin, cout in ((1, 32), (32, 64)):
            x = L.MaxPool2d(2)(L.Activation("relu")(L.Conv2d(cin, cout, 3, padding=1)(x)))
        x = L.Linear(128, 10)(L.Linear(64 * 7 * 7, 128, activation="relu")(L.Reshape((64 * 7 * 7,))(x)))
        net.outputs(y=x)
    else:
        block = lambda x, i, o: L.Activation("relu")(L.BatchNorm3d(o, frozen_statistics=True)(
            L.Conv3d(i, o, 3, padding=1)(x)))
        e1 = block(net.input("x", (1, 24, 24, 24)), 1, 16)
        up = L.ConvTranspose3d(32, 16, 2, stride=2)(block(L.MaxPool3d(2)(e1), 16, 32))
        net.outputs(y=L.Conv3d(16, 1, 1)(block(L.ConcatChannels()(up, e1), 32, 16)))
    return net


def export_models():
    """Write build/bench/onnx/<case>.onnx (once)."""
    import warnings
    import torch
    os.makedirs(FOLDER, exist_ok=True)
    for name, cls in _models().items():
        path = os.path.join(FOLDER, f"{name}.onnx")
        if os.path.exists(path):
            continue
        torch.manual_seed(0)
        model = cls().eval()
        shape = CASES[name][0]
        sequence = name in ("lstm_lm", "gru_classifier")
        example = torch.randint(0, 4096, (2, 7)) if sequence else torch.randn(2, *shape[1:])
        axes = {0: "n", 1: "t"} if sequence else {0: "n"}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if name in STATIC:  # as a user exports: the default exporter, the example's own shapes
                torch.onnx.export(model, (torch.randn(*shape),), path, input_names=["x"], output_names=["y"])
            elif name == "gru_classifier":
                torch.onnx.export(model, (example, torch.tensor([7, 5])), path, dynamo=False, opset_version=17,
                                  input_names=["x", "lengths"], output_names=["y", "states"],
                                  dynamic_axes={"x": axes, "lengths": {0: "n"}, "y": {0: "n"}, "states": axes})
            else:
                torch.onnx.export(model, (example,), path, dynamo=False, opset_version=17, input_names=["x"],
                                  output_names=["y"], dynamic_axes={"x": axes, "y": axes})
    from onnxruntime.quantization import QuantType, quantize_dynamic
    for name in QUANTIZED:
        quantized = os.path.join(FOLDER, f"{name}_int8.onnx")
        if not os.path.exists(quantized):
            quantize_dynamic(os.path.join(FOLDER, f"{name}.onnx"), quantized, weight_type=QuantType.QInt8)


def _inputs(name):
    """The case's feeds as ONNX Runtime takes them."""
    rng = np.random.default_rng(0)
    if name in ("lstm_lm", "gru_classifier"):
        feeds = {"x": rng.integers(0, 4096, CASES[name][0])}
        if name == "gru_classifier":
            feeds["lengths"] = LM_LENGTHS.astype(np.int64)
        return feeds
    return {"x": rng.standard_normal(CASES[name][0]).astype(np.float32)}


def _lamina_feeds(name):
    import lamina as lm
    x = _inputs(name)["x"]
    if name in ("lstm_lm", "gru_classifier"):  # the same ids, each sequence at its own length: no padding
        x = lm.Sequences.from_padded(x.astype(np.int32), LM_LENGTHS)
    return {"x": x}


def lamina_onnx(name, suffix=""):
    import lamina as lm
    net = lm.onnx.load(os.path.join(FOLDER, f"{name}{suffix}.onnx"))
    feeds = _lamina_feeds(name)
    outputs = ["y"]  # (the classifier's per-step outputs are a by-product of the export)
    return lambda: net.run(feeds, outputs)


def lamina_native(name):
    net = native(name)
    feeds = _lamina_feeds(name)
    return lambda: net.run(feeds)


def ort_onnx(name, threads, suffix="", spin=True):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    if not spin:  # (its workers sleep between calls instead of watching for work)
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(os.path.join(FOLDER, f"{name}{suffix}.onnx"), options,
                                   providers=["CPUExecutionProvider"])
    feeds = _inputs(name)
    return lambda: session.run(["y"], feeds)


def run(bench, threads, rounds, have_torch, have_ort=False):
    if not (have_torch and have_ort):
        return []
    export_models()
    rows = []
    for name in CASES:
        impls = {"lamina": ("bench.onnx:lamina_onnx", [name]), "onnxruntime": ("bench.onnx:ort_onnx", [name, threads])}
        if name not in STATIC:
            impls["lamina-native"] = ("bench.onnx:lamina_native", [name])
        rows += bench.time_case("onnx", f"{name} infer b{CASES[name][0][0]}", threads, impls, None, rounds)
    for name in QUANTIZED:
        impls = {"lamina": ("bench.onnx:lamina_onnx", [name, "_int8"]),
                 "lamina-float32": ("bench.onnx:lamina_onnx", [name]),
                 "onnxruntime": ("bench.onnx:ort_onnx", [name, threads, "_int8"])}
        rows += bench.time_case("onnx", f"{name} infer b{CASES[name][0][0]} int8", threads, impls, None, rounds)
    return rows
