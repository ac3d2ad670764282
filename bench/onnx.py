"""Suite `onnx`: the same .onnx files run by lamina (lm.onnx.load) and by ONNX Runtime, same
inputs, same thread count, inference: a 2-D CNN (Conv2d, ReLU, MaxPool2d, Flatten, Linear) and
a 3-D U-Net (Conv3d, BatchNorm3d, ReLU, MaxPool3d, ConvTranspose3d, skip Concat), exported by
PyTorch's TorchScript exporter. The recurrent models of the issue come with the recurrent import.

The files are written once into build/bench/onnx/ by the parent (PyTorch needed), then every
worker reads them.
"""
import os

import numpy as np

from .harness import ROOT

FOLDER = os.path.join(ROOT, "build", "bench", "onnx")
CASES = {
    # name: (input shape, multiply-adds per sample, for GFLOP/s)
    "cnn": ((64, 1, 28, 28), None),
    "unet3d": ((4, 1, 24, 24, 24), None),
}


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

    return {"cnn": CNN, "unet3d": UNet3d}


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
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (torch.randn(2, *shape[1:]),), path, dynamo=False, opset_version=17,
                              input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})


def _input(name):
    return np.random.default_rng(0).standard_normal(CASES[name][0]).astype(np.float32)


def lamina_onnx(name):
    import lamina as lm
    net = lm.onnx.load(os.path.join(FOLDER, f"{name}.onnx"))
    feeds = {"x": _input(name)}
    return lambda: net.run(feeds)


def ort_onnx(name, threads):
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(os.path.join(FOLDER, f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
    feeds = {"x": _input(name)}
    return lambda: session.run(None, feeds)


def run(bench, threads, rounds, have_torch, have_ort=False):
    if not (have_torch and have_ort):
        return []
    export_models()
    rows = []
    for name in CASES:
        impls = {"lamina": ("bench.onnx:lamina_onnx", [name]), "onnxruntime": ("bench.onnx:ort_onnx", [name, threads])}
        rows += bench.time_case("onnx", f"{name} infer b{CASES[name][0][0]}", threads, impls, None, rounds)
    return rows
