"""Suite `fc`: a fully-connected layer, forward and forward+backward (input, weight and bias
gradients), against torch.nn.Linear and against the raw sgemm calls it is made of, on the same
arrays (MKL and OpenBLAS; the faster is the yardstick)."""
import numpy as np

from .harness import RAW_GEMM, lamina_step

SHAPES = [(64, 1024, 1024), (256, 1024, 1024), (64, 512, 4096), (256, 512, 4096)]
MODES = {"fwd": 1, "fwd+bwd": 3}  # GEMMs per call


def _data(batch, n_in, n_out):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch, n_in)).astype(np.float32),
            rng.standard_normal((batch, n_out)).astype(np.float32))


def lamina_fc(mode, batch, n_in, n_out):
    import lamina as lm
    net = lm.Network()
    x = net.input("x", n_in)
    x.requires_grad = True  # a layer inside a network computes its input gradient too
    net.outputs(y=lm.layers.Linear(n_in, n_out)(x))
    X, G = _data(batch, n_in, n_out)
    return lamina_step(net, {"x": X}, {"y": G}, mode)


def torch_fc(mode, batch, n_in, n_out):
    import torch
    lin = torch.nn.Linear(n_in, n_out)
    X, G = (torch.from_numpy(a) for a in _data(batch, n_in, n_out))
    X.requires_grad_(True)

    def forward():
        with torch.no_grad():
            lin(X)

    def forward_backward():
        lin.zero_grad(set_to_none=False)
        X.grad = None
        lin(X).backward(G)
    return forward if mode == "fwd" else forward_backward


def raw_fc(provider_name, mode, batch, n_in, n_out):
    """The layer's GEMMs alone: y = x Wᵀ; backward dx = dy W, dW = dyᵀ x."""
    from .harness import raw_provider
    p = raw_provider(provider_name)
    x, dy = _data(batch, n_in, n_out)
    w = np.random.default_rng(1).standard_normal((n_out, n_in)).astype(np.float32)
    y, dx, dw = np.empty_like(dy), np.empty_like(x), np.empty_like(w)

    def forward():
        p.gemm(x, w, y, False, True, 1.0, 0.0)

    def forward_backward():
        forward()
        p.gemm(dy, w, dx, False, False, 1.0, 0.0)
        p.gemm(dy, x, dw, True, False, 1.0, 0.0)
    return forward if mode == "fwd" else forward_backward


def run(bench, threads, rounds, have_torch):
    rows = []
    for batch, n_in, n_out in SHAPES:
        for mode, gemms in MODES.items():
            shape = [mode, batch, n_in, n_out]
            impls = {"lamina": ("bench.fc:lamina_fc", shape)}
            if have_torch:
                impls["torch"] = ("bench.fc:torch_fc", shape)
            for impl, name in RAW_GEMM.items():
                impls[impl] = ("bench.fc:raw_fc", [name] + shape)
            rows += bench.time_case("fc", f"{mode} b{batch} {n_in}->{n_out}", threads, impls,
                                    gemms * 2.0 * batch * n_in * n_out, rounds)
    return rows
