"""Optimizers: updates through the network match an independent numpy implementation; schedules,
multipliers, clipping and state; PyTorch parity where PyTorch is importable."""
import math

import numpy as np
import pytest

import lamina as lm
from lamina.layers import Linear, SquareError

from helpers import rand


def regression(seed=0):
    lm.manual_seed(seed)
    net = lm.Network(dtype="float64")
    x = net.input("x", 3)
    fc = Linear(3, 2, name="fc")
    net.outputs(c=SquareError()(fc(x), net.input("t", 2)))
    net.astype("float64")
    rng = np.random.default_rng(seed)
    feeds = {"x": rand(rng, 8, 3), "t": rand(rng, 8, 2)}
    return net, fc, feeds


def numpy_grads(W, b, feeds):
    X, T = feeds["x"], feeds["t"]
    d = 2 * (X @ W.T + b - T) / len(X)
    return d.T @ X, d.sum(0)


def numpy_adam(params, grads, state, t, lr, b1=0.9, b2=0.999, eps=1e-8, wd=0.0, decoupled=False):
    out = []
    for i, (p, g) in enumerate(zip(params, grads)):
        m, v = state.setdefault(i, (np.zeros_like(p), np.zeros_like(p)))
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        state[i] = (m, v)
        out.append(p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps))
    return out


@pytest.mark.parametrize("decoupled", [False, True])
def test_adam_through_the_network_matches_numpy(decoupled):
    net, fc, feeds = regression()
    opt = (lm.optim.AdamW if decoupled else lm.optim.Adam)(net, lr=0.05, weight_decay=0.1)
    W, b, state = fc.weight.value.copy(), fc.bias.value.copy(), {}
    for t in range(1, 6):
        net.train_step(feeds, opt)
        W, b = numpy_adam([W, b], numpy_grads(W, b, feeds), state, t, 0.05, wd=0.1, decoupled=decoupled)
    np.testing.assert_allclose(fc.weight.value, W, rtol=1e-12)
    np.testing.assert_allclose(fc.bias.value, b, rtol=1e-12)
    assert int(fc.weight.state["step"]) == 5 and set(fc.weight.state) == {"exp_avg", "exp_avg_sq", "step"}


def test_sgd_momentum_nesterov_matches_numpy():
    net, fc, feeds = regression(1)
    opt = lm.optim.SGD(net, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)
    W, b = fc.weight.value.copy(), fc.bias.value.copy()
    vW, vb = np.zeros_like(W), np.zeros_like(b)
    for _ in range(5):
        net.train_step(feeds, opt)
        gW, gb = numpy_grads(W, b, feeds)
        gW, gb = gW + 0.01 * W, gb + 0.01 * b
        vW, vb = 0.9 * vW + gW, 0.9 * vb + gb
        W, b = W - 0.1 * (gW + 0.9 * vW), b - 0.1 * (gb + 0.9 * vb)
    np.testing.assert_allclose(fc.weight.value, W, rtol=1e-12)
    np.testing.assert_allclose(fc.bias.value, b, rtol=1e-12)


def test_lr_multipliers():
    net, fc, feeds = regression(2)
    fc.bias.lr_mult = 0.0
    fc.weight.lr_mult = 2.0
    b0, W0 = fc.bias.value.copy(), fc.weight.value.copy()
    gW, _ = numpy_grads(W0, b0, feeds)
    net.train_step(feeds, lm.optim.SGD(net, lr=0.1))
    np.testing.assert_array_equal(fc.bias.value, b0)
    np.testing.assert_allclose(fc.weight.value, W0 - 0.2 * gW, rtol=1e-12)


def test_global_norm_clipping():
    net, fc, feeds = regression(3)
    W0, b0 = fc.weight.value.copy(), fc.bias.value.copy()
    gW, gb = numpy_grads(W0, b0, feeds)
    norm = math.sqrt((gW ** 2).sum() + (gb ** 2).sum())
    clip = norm / 4
    opt = lm.optim.SGD(net, lr=1.0, clip_norm=clip)
    net.train_step(feeds, opt)
    assert opt.last_grad_norm == pytest.approx(norm, rel=1e-12)
    scale = clip / (norm + 1e-6)
    np.testing.assert_allclose(fc.weight.value, W0 - scale * gW, rtol=1e-10)
    np.testing.assert_allclose(fc.bias.value, b0 - scale * gb, rtol=1e-10)


def test_schedules():
    assert [lm.optim.StepDecay(2, 0.5)(s) for s in range(5)] == [1, 1, 0.5, 0.5, 0.25]
    cos = lm.optim.CosineWarmup(warmup=3, total=13, min_factor=0.1)
    assert [cos(s) for s in range(3)] == pytest.approx([0.25, 0.5, 0.75])
    assert cos(3) == pytest.approx(1.0)
    assert cos(8) == pytest.approx(0.55)
    assert cos(13) == pytest.approx(0.1) and cos(100) == pytest.approx(0.1)


def test_schedule_drives_the_learning_rate():
    net, fc, feeds = regression(4)
    opt = lm.optim.SGD(net, lr=1.0, schedule=lm.optim.StepDecay(1, 0.5))
    seen = []
    for _ in range(3):
        net.train_step(feeds, opt)
        seen.append(opt.current_lr)
    assert seen == [1.0, 0.5, 0.25] and opt.step_count == 3


@pytest.mark.parametrize("name", ["AdaGrad", "RMSProp"])
def test_adaptive_optimizers_reduce_the_loss(name):
    net, fc, feeds = regression(5)
    opt = getattr(lm.optim, name)(net, lr=0.05)
    first = net.train_step(feeds, opt)
    for _ in range(30):
        last = net.train_step(feeds, opt)
    assert last < 0.7 * first


def test_optimizer_argument_errors():
    net, fc, feeds = regression()
    with pytest.raises(ValueError, match=r"SGD: lr must be a finite number in \(0, inf\), found 0"):
        lm.optim.SGD(net, lr=0)
    bad = [(lm.optim.SGD, dict(lr=float("nan"))), (lm.optim.Adam, dict(lr=float("inf"))),
           (lm.optim.SGD, dict(lr=0.1, momentum=-0.5)), (lm.optim.SGD, dict(lr=0.1, momentum=float("nan"))),
           (lm.optim.Adam, dict(betas=(0.9, 1.0))), (lm.optim.Adam, dict(eps=0)),
           (lm.optim.AdamW, dict(weight_decay=-1)), (lm.optim.RMSProp, dict(alpha=float("nan"))),
           (lm.optim.AdaGrad, dict(eps=float("nan"))), (lm.optim.SGD, dict(lr=0.1, clip_norm=float("nan"))),
           (lm.optim.SGD, dict(lr="fast"))]
    for kind, kw in bad:
        with pytest.raises(ValueError, match="must be a"):
            kind(net, **kw)
    with pytest.raises(ValueError, match="nonfinite must be one of skip, raise, apply"):
        lm.optim.SGD(net, lr=0.1, nonfinite="ignore")
    with pytest.raises(ValueError, match="Nesterov momentum needs momentum > 0"):
        lm.optim.SGD(net, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="no parameters"):
        lm.optim.Adam([], lr=0.1)


# ---------------------------------------------------------------- PyTorch parity (optional)

TORCH_CASES = {
    "SGD": ({"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "Nesterov": ({"lr": 0.1, "momentum": 0.9, "nesterov": True}, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "Adam": ({"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.1}),
    "AdamW": ({"lr": 0.01, "weight_decay": 0.1}, {"lr": 0.01, "weight_decay": 0.1}),
    "AdaGrad": ({"lr": 0.1}, {"lr": 0.1}),
    "RMSProp": ({"lr": 0.01, "momentum": 0.5}, {"lr": 0.01, "momentum": 0.5}),
}
TORCH_NAMES = {"SGD": "SGD", "Nesterov": "SGD", "Adam": "Adam", "AdamW": "AdamW", "AdaGrad": "Adagrad", "RMSProp": "RMSprop"}


@pytest.mark.parametrize("case", sorted(TORCH_CASES))
def test_optimizers_match_pytorch(case):
    import torch  # a test extra: installed by make test, never skipped
    ours, theirs = TORCH_CASES[case]
    net, fc, feeds = regression(6)
    lin = torch.nn.Linear(3, 2).double()
    with torch.no_grad():
        lin.weight.copy_(torch.from_numpy(fc.weight.value.copy()))
        lin.bias.copy_(torch.from_numpy(fc.bias.value.copy()))
    topt = getattr(torch.optim, TORCH_NAMES[case])(lin.parameters(), **theirs)
    opt = getattr(lm.optim, "SGD" if case == "Nesterov" else case)(net, **ours)
    X, T = torch.from_numpy(feeds["x"]), torch.from_numpy(feeds["t"])
    for _ in range(5):
        net.train_step(feeds, opt)
        topt.zero_grad()
        ((lin(X) - T) ** 2).sum(1).mean().backward()
        topt.step()
    np.testing.assert_allclose(fc.weight.value, lin.weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(fc.bias.value, lin.bias.detach().numpy(), rtol=1e-10, atol=1e-12)
