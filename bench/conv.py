"""Suite `conv`: 3-D convolution and transposed convolution, forward and forward+backward
(input, weight and bias gradients), against PyTorch in its default memory format and in
channels_last_3d (the faster of the two is the peer that counts). Shapes from the issue:
  A: ConvTranspose3d N=8, 32->16, 16^3, kernel 3, stride 2, padding 1, output_padding 1
  B: the same with groups=4
  C: ConvTranspose3d N=2, 64->64, 8^3, kernel 4, stride 2, padding 1
  D: Conv3d N=8, 16->32, 32^3, kernel 3, stride 1, padding 1
  E: Conv3d N=8, 32->64, 32^3, kernel 3, stride 2, padding 1 (a U-Net's or ResNet's downsampling)
  F: ConvTranspose3d N=8, 32->16, 16^3, kernel 2, stride 2 (a U-Net's up-convolution)
The last column names the algorithm lamina's CPU backend runs (forward; and input gradient,
weight gradient for fwd+bwd).
GFLOP/s count the convolution's multiply-adds (2 per weight tap per output of the direct form)."""
import numpy as np

from .harness import lamina_step

CASES = {
    "A": dict(transposed=True, n=8, cin=32, cout=16, size=16, k=3, s=2, p=1, op=1, groups=1),
    "B": dict(transposed=True, n=8, cin=32, cout=16, size=16, k=3, s=2, p=1, op=1, groups=4),
    "C": dict(transposed=True, n=2, cin=64, cout=64, size=8, k=4, s=2, p=1, op=0, groups=1),
    "D": dict(transposed=False, n=8, cin=16, cout=32, size=32, k=3, s=1, p=1, op=0, groups=1),
    "E": dict(transposed=False, n=8, cin=32, cout=64, size=32, k=3, s=2, p=1, op=0, groups=1),
    "F": dict(transposed=True, n=8, cin=32, cout=16, size=16, k=2, s=2, p=0, op=0, groups=1),
}


def flops(case):
    c = CASES[case]
    # every (input position, output channel of its group, tap) for transposed; every (output
    # position, input channel of its group, tap) for conv
    if c["transposed"]:
        return 2.0 * c["n"] * c["size"] ** 3 * c["cin"] * (c["cout"] // c["groups"]) * c["k"] ** 3
    out = (c["size"] + 2 * c["p"] - c["k"]) // c["s"] + 1
    return 2.0 * c["n"] * out ** 3 * c["cout"] * (c["cin"] // c["groups"]) * c["k"] ** 3


def _input(c):
    return np.random.default_rng(0).standard_normal((c["n"], c["cin"]) + (c["size"],) * 3).astype(np.float32)


def lamina_layer(case):
    import lamina as lm
    c = CASES[case]
    if c["transposed"]:
        return lm.layers.ConvTranspose3d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["p"],
                                         output_padding=c["op"], groups=c["groups"])
    return lm.layers.Conv3d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["p"], groups=c["groups"])


def algorithm(case, mode):
    """What the CPU backend runs: the forward's algorithm, and for fwd+bwd each gradient's."""
    import lamina as lm
    steps = lamina_layer(case).algorithms(lm.CPUBackend())
    if mode == "fwd":
        return steps["forward"]
    return " / ".join(steps[k] for k in ("forward", "input grad", "weight grad"))


def lamina_conv(case, mode, device="cpu"):
    import lamina as lm
    c = CASES[case]
    net = lm.Network()
    x = net.input("x", (c["cin"],) + (c["size"],) * 3)
    x.requires_grad = True
    layer = lamina_layer(case)
    y = layer(x)
    net.outputs(y=y)
    grad = {"y": np.random.default_rng(1).standard_normal((c["n"],) + y.spec.shape).astype(np.float32)}
    return lamina_step(net, {"x": _input(c)}, grad, mode, device)


def torch_conv(case, mode, memory_format):
    import torch
    c = CASES[case]
    if c["transposed"]:
        layer = torch.nn.ConvTranspose3d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["p"],
                                         output_padding=c["op"], groups=c["groups"])
    else:
        layer = torch.nn.Conv3d(c["cin"], c["cout"], c["k"], stride=c["s"], padding=c["p"], groups=c["groups"])
    x = torch.from_numpy(_input(c))
    if memory_format == "channels_last_3d":
        layer = layer.to(memory_format=torch.channels_last_3d)
        x = x.contiguous(memory_format=torch.channels_last_3d)
    x.requires_grad_(True)
    with torch.no_grad():
        g = torch.randn_like(layer(x))

    def forward():
        with torch.no_grad():
            layer(x)

    def forward_backward():
        layer.zero_grad(set_to_none=False)
        x.grad = None
        layer(x).backward(g)
    return forward if mode == "fwd" else forward_backward


def run(bench, threads, rounds, have_torch):
    rows = []
    for case in CASES:
        for mode, mult in (("fwd", 1), ("fwd+bwd", 3)):
            impls = {"lamina": ("bench.conv:lamina_conv", [case, mode])}
            if have_torch:
                impls["torch"] = ("bench.conv:torch_conv", [case, mode, "contiguous"])
                impls["torch-cl3d"] = ("bench.conv:torch_conv", [case, mode, "channels_last_3d"])
            timed = bench.time_case("conv", f"{case} {mode}", threads, impls, mult * flops(case), rounds,
                                    turn_seconds=0.2, with_peak=True)
            for row in timed:
                if row.impl == "lamina":
                    row.algorithm = algorithm(case, mode)
            rows += timed
    return rows
