"""Pooling, batch normalisation and channel concatenation: gradient checks, the numpy reference
backend, PyTorch parity where PyTorch is importable, and running statistics."""
import numpy as np
import pytest

import lamina as lm
from lamina.backends.reference import ReferenceBackend
from lamina.layers import (AvgPool2d, AvgPool3d, BatchNorm2d, BatchNorm3d, ConcatChannels, Conv2d, Conv3d, MaxPool2d,
                           MaxPool3d)
from lamina.testing import add_probe_cost, check_gradients, probe_feed

POOLS = [
    (MaxPool3d, (3, 5, 4, 6), dict(kernel_size=2)),
    (MaxPool3d, (2, 5, 6, 5), dict(kernel_size=3, stride=(1, 2, 2), padding=1)),
    (AvgPool3d, (3, 5, 4, 6), dict(kernel_size=2, stride=1)),
    (AvgPool3d, (2, 5, 6, 5), dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    (AvgPool3d, (2, 4, 5, 5), dict(kernel_size=(3, 2, 3), stride=2, padding=(1, 1, 0), count_include_pad=True)),
    (MaxPool2d, (3, 7, 6), dict(kernel_size=3, stride=2, padding=1)),
    (AvgPool2d, (3, 7, 6), dict(kernel_size=3, stride=2, padding=1, count_include_pad=False)),
    # ceil_mode (windows that end past the input), padding before and after each axis
    (MaxPool2d, (2, 7, 6), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True)),
    (MaxPool3d, (2, 5, 6, 5), dict(kernel_size=2, stride=2, ceil_mode=True)),
    (AvgPool2d, (2, 7, 6), dict(kernel_size=3, stride=2, padding=1, ceil_mode=True, count_include_pad=False)),
    (MaxPool2d, (2, 7, 6), dict(kernel_size=3, stride=2, padding=((1, 0), (0, 1)))),
    (AvgPool3d, (2, 5, 4, 6), dict(kernel_size=(3, 2, 3), stride=2, padding=((1, 0), (0, 1), (1, 1)))),
    # every window inside (pools.h): 2x2 of stride 2 in whole vectors of outputs and a rest (odd
    # input sizes drop their last row and column), and other windows tap by tap
    (MaxPool2d, (3, 5, 37), dict(kernel_size=2)),
    (MaxPool3d, (2, 3, 4, 19), dict(kernel_size=(1, 2, 2))),
    (MaxPool3d, (2, 5, 5, 9), dict(kernel_size=(2, 3, 2), stride=(1, 2, 1))),
    # dilated windows (taps dilation apart; padding up to half the dilated span)
    (MaxPool2d, (3, 9, 10), dict(kernel_size=3, stride=1, padding=1, dilation=2)),
    (MaxPool3d, (2, 5, 7, 8), dict(kernel_size=2, stride=(1, 2, 1), padding=(0, 1, 1), dilation=(2, 3, 2))),
    (MaxPool2d, (2, 9, 8), dict(kernel_size=2, stride=2, dilation=3, ceil_mode=True)),
    (AvgPool2d, (3, 9, 10), dict(kernel_size=3, stride=2, padding=2, dilation=2, count_include_pad=False)),
    (AvgPool3d, (2, 5, 7, 8), dict(kernel_size=(2, 2, 3), stride=1, dilation=(2, 3, 2))),
]
POOL_IDS = [f"{p[0].__name__}-{i}" for i, p in enumerate(POOLS)]


def probed(layer, shape, batch=2, seed=0):
    net = lm.Network()
    x = net.input("x", shape)
    y = layer(x)
    probe = add_probe_cost(net, y)
    net.astype("float64")
    rng = np.random.default_rng(seed)
    return net, {"x": rng.standard_normal((batch,) + shape), probe: probe_feed(net, probe, batch, seed)}, y


@pytest.mark.parametrize("case", POOLS, ids=POOL_IDS)
def test_pool_gradients(case):
    layer_type, shape, kw = case
    net, feeds, _ = probed(layer_type(**kw), shape)
    check_gradients(net, feeds)


@pytest.mark.parametrize("case", POOLS, ids=POOL_IDS)
def test_pool_matches_reference(case):
    layer_type, shape, kw = case
    net = lm.Network(dtype="float64")
    x = net.input("x", shape)
    net.outputs(y=layer_type(**kw)(x))
    net.astype("float64")
    X = np.random.default_rng(1).standard_normal((2,) + shape)
    got = net.run({"x": X})["y"]
    ref_net = lm.Network(dtype="float64", backend=ReferenceBackend())
    net2_x = ref_net.input("x", shape)
    ref_net.outputs(y=layer_type(**kw)(net2_x))
    np.testing.assert_allclose(got, ref_net.run({"x": X})["y"], rtol=1e-13)


@pytest.mark.parametrize("layer_type,shape", [(BatchNorm3d, (3, 4, 3, 5)), (BatchNorm2d, (3, 5, 4))])
@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_gradients(layer_type, shape, affine):
    net, feeds, _ = probed(layer_type(3, affine=affine), shape, batch=3)
    check_gradients(net, feeds)


@pytest.mark.parametrize("affine", [True, False])
def test_batch_norm_gradients_with_running_statistics(affine):
    """frozen_statistics: the running statistics in training too (a model fine-tuned in eval
    mode): float64 gradient check, and the numpy reference of the affine map and its gradient."""
    bn = BatchNorm3d(2, affine=affine, frozen_statistics=True)
    net, feeds, y = probed(bn, (2, 3, 2, 3))
    stats = {"running_mean": np.array([0.5, -1.0]), "running_var": np.array([2.0, 0.5])}
    for name, value in stats.items():
        bn.params[name].assign(value)
    if affine:
        bn.params["weight"].assign(np.array([1.5, -0.5]))
        bn.params["bias"].assign(np.array([0.25, 2.0]))
    check_gradients(net, feeds)
    for name, value in stats.items():  # never updated by the training passes
        np.testing.assert_array_equal(bn.params[name].value, value)
    x = feeds["x"]
    scale = 1 / np.sqrt(stats["running_var"] + 1e-5) * (np.array([1.5, -0.5]) if affine else 1)
    shift = -stats["running_mean"] * scale + (np.array([0.25, 2.0]) if affine else 0)
    per_channel = lambda v: v.reshape(1, 2, 1, 1, 1)
    net.outputs(y=y)
    dy = np.random.default_rng(3).standard_normal(x.shape)
    out = net.forward({"x": x}, grad_outputs=["y"], outputs=["y"])["y"]
    np.testing.assert_allclose(out, x * per_channel(scale) + per_channel(shift), rtol=1e-12)
    net.values["x"].requires_grad = True
    net.forward({"x": x}, grad_outputs=["y"], outputs=["y"])
    net.backward(grad_outputs={"y": dy})
    np.testing.assert_allclose(net.grad("x"), dy * per_channel(scale), rtol=1e-12)
    if affine:
        xhat = (x - per_channel(stats["running_mean"])) / per_channel(np.sqrt(stats["running_var"] + 1e-5))
        np.testing.assert_allclose(bn.params["weight"].grad, (dy * xhat).sum((0, 2, 3, 4)), rtol=1e-10)
        np.testing.assert_allclose(bn.params["bias"].grad, dy.sum((0, 2, 3, 4)), rtol=1e-10)


def test_batch_norm_running_statistics_follow_pytorch():
    import torch  # a test extra: installed by make test, never skipped
    bn = BatchNorm3d(4, momentum=0.2)
    net = lm.Network()
    x = net.input("x", (4, 3, 5, 2))
    y = bn(x)
    net.outputs(y=y)
    tbn = torch.nn.BatchNorm3d(4, momentum=0.2)
    rng = np.random.default_rng(3)
    for step in range(3):
        X = (2 * rng.standard_normal((5, 4, 3, 5, 2)) + step).astype(np.float32)
        G = rng.standard_normal(X.shape).astype(np.float32)
        x.requires_grad = True
        out = net.forward({"x": X}, grad_outputs=["y"])["y"].copy()
        net.backward(grad_outputs={"y": G})
        tx = torch.from_numpy(X).requires_grad_(True)
        ty = tbn(tx)
        ty.backward(torch.from_numpy(G))
        np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(net.grad("x"), tx.grad.numpy(), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(bn.params["weight"].grad, tbn.weight.grad.numpy(), rtol=1e-4, atol=1e-4)
        net.zero_grad()
        tbn.zero_grad()
    np.testing.assert_allclose(bn.params["running_mean"].value, tbn.running_mean.numpy(), rtol=1e-5)
    np.testing.assert_allclose(bn.params["running_var"].value, tbn.running_var.numpy(), rtol=1e-5)
    tbn.eval()
    X = rng.standard_normal((2, 4, 3, 5, 2)).astype(np.float32)
    with torch.no_grad():
        np.testing.assert_allclose(net.run({"x": X})["y"], tbn(torch.from_numpy(X)).numpy(), rtol=1e-5, atol=1e-5)


# PyTorch's average pools have no dilation: a 2-D one is compared with PyTorch's unfold (below);
# the 3-D one is held to the reference and the gradient check alone
TORCH_POOLS = [(case, name) for case, name in zip(POOLS, POOL_IDS)
               if not (case[0] is AvgPool3d and "dilation" in case[2])]


def dilated_average(torch, tx, kw):
    """A dilated 2-D average pool from PyTorch's unfold (zeros where windows pass the edge)."""
    F = torch.nn.functional
    window = dict(kernel_size=kw["kernel_size"], dilation=kw["dilation"], padding=kw.get("padding", 0),
                  stride=kw["stride"])
    n, c, h, w = tx.shape
    sums = F.unfold(tx, **window).reshape(n, c, -1, F.unfold(tx[:, :1], **window).shape[-1]).sum(2)
    counts = F.unfold(torch.ones(1, 1, h, w, dtype=tx.dtype), **window).sum(1)
    if kw.get("count_include_pad", True):
        counts = torch.full_like(counts, float(np.prod(np.broadcast_to(kw["kernel_size"], 2))))
    out = sums / counts
    rows = (h + 2 * window["padding"] - kw["dilation"] * (kw["kernel_size"] - 1) - 1) // kw["stride"] + 1
    return out.reshape(n, c, rows, -1)


@pytest.mark.parametrize("case", [c for c, _ in TORCH_POOLS], ids=[i for _, i in TORCH_POOLS])
def test_pool_matches_pytorch(case):
    import torch  # a test extra: installed by make test, never skipped
    layer_type, shape, kw = case
    net = lm.Network()
    x = net.input("x", shape)
    net.outputs(y=layer_type(**kw)(x))
    X = np.random.default_rng(4).standard_normal((2,) + shape).astype(np.float32)
    kw, tx = dict(kw), torch.from_numpy(X)
    if isinstance(kw.get("padding"), tuple) and isinstance(kw["padding"][0], tuple):
        # PyTorch pads both sides alike: pad explicitly (-inf never wins a maximum; zeros count
        # in an average with count_include_pad, the default)
        sides = [side for pair in reversed(kw.pop("padding")) for side in pair]
        tx = torch.nn.functional.pad(tx, sides, value=-np.inf if "Max" in layer_type.__name__ else 0.0)
    if "Avg" in layer_type.__name__ and "dilation" in kw:
        want = dilated_average(torch, tx, kw)
    else:
        want = getattr(torch.nn, layer_type.__name__)(**kw)(tx)
    np.testing.assert_allclose(net.run({"x": X})["y"], want.numpy(), rtol=1e-5, atol=1e-6)


def test_dilated_pools_round_trip_through_model_files_and_refuse_bad_settings(tmp_path):
    net = lm.Network()
    x = net.input("x", (2, 9, 9))
    net.outputs(y=MaxPool2d(3, 1, 2, dilation=2)(x))
    lm.save(net, tmp_path / "m.lamina")
    X = np.random.default_rng(6).standard_normal((1, 2, 9, 9)).astype(np.float32)
    np.testing.assert_array_equal(lm.load(tmp_path / "m.lamina").run({"x": X})["y"], net.run({"x": X})["y"])
    with pytest.raises(ValueError, match="dilation must be at least 1"):
        MaxPool2d(2, dilation=0)
    with pytest.raises(ValueError, match=r"at most half the kernel size \(its span, dilated\)"):
        MaxPool2d(3, padding=3, dilation=2)


def test_batch_norm_parameters_are_saved_and_running_stats_never_trained(tmp_path):
    net = lm.Network()
    x = net.input("x", (2, 3, 3, 3))
    bn = BatchNorm3d(2, name="bn")
    net.outputs(c=lm.layers.SquareError()(bn(Conv3d(2, 2, 3, padding=1)(x)), net.input("t", (2, 3, 3, 3))))
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((4, 2, 3, 3, 3)).astype(np.float32),
             "t": rng.standard_normal((4, 2, 3, 3, 3)).astype(np.float32)}
    opt = lm.optim.Adam(net, lr=0.01)
    net.freeze("bn", frozen=False)  # unfreezing a layer leaves its running statistics untrained
    for _ in range(3):
        net.train_step(feeds, opt)
    assert bn.params["running_mean"].frozen and bn.params["running_mean"].grad is None
    lm.save(net, tmp_path / "m.lamina")
    loaded = lm.load(tmp_path / "m.lamina")
    np.testing.assert_array_equal(loaded.layer("bn").params["running_var"].value, bn.params["running_var"].value)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_max_pool_ties_and_nan_choose_as_the_generic_loop(dtype):
    """pools.h's 2x2 windows: of equal maxima the first in window order wins (its position goes
    to argmax); a NaN stays only as a window's first tap (no value compares greater than it, and
    it compares greater than none), as in the generic loop."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 3, (4, 1, 6, 34)).astype(dtype)  # many ties
    x[0, 0, 0, 0], x[1, 0, 2, 7] = np.nan, np.nan
    out = np.empty((4, 1, 3, 17), dtype)
    argmax = np.empty((4, 51), np.int32)
    lm.CPUBackend().max_pool(x, out, argmax, ((1, 2, 2), (1, 2, 2), (0, 0, 0)))
    windows = x.reshape(4, 3, 2, 17, 2).transpose(0, 1, 3, 2, 4).reshape(4, 3, 17, 4)
    first = np.argmax(windows == np.nanmax(windows, axis=-1, keepdims=True), axis=-1)
    first[0, 0, 0] = 0  # the window whose first tap is NaN
    rows, cols = np.meshgrid(np.arange(3), np.arange(17), indexing="ij")
    want_at = (2 * rows + first // 2) * 34 + 2 * cols + first % 2
    np.testing.assert_array_equal(argmax.reshape(4, 3, 17), want_at)
    np.testing.assert_array_equal(out[:, 0], np.take_along_axis(windows, first[..., None], -1)[..., 0])
    assert np.isnan(out[0, 0, 0, 0]) and not np.isnan(out[1]).any()
    # inference keeps no positions (argmax None): the same maxima, tails of every width
    for width in (34, 30, 18, 14, 2):
        alone = np.full((4, 1, 3, width // 2), -1, dtype)
        lm.CPUBackend().max_pool(np.ascontiguousarray(x[..., :width]), alone, None, ((1, 2, 2), (1, 2, 2), (0, 0, 0)))
        np.testing.assert_array_equal(alone, out[..., :width // 2], err_msg=width)


@pytest.mark.parametrize("kind", ["relu", "elu"])
def test_batch_norm_applies_a_following_activation_at_inference(kind):
    """conv -> BatchNorm -> activation: inference runs the activation inside the batch norm (the
    ReLU in the same pass, others after it), equal to applying it to the batch norm's output."""
    net = lm.Network()
    bn = lm.layers.BatchNorm3d(3, name="bn")
    pre = bn(Conv3d(2, 3, 3, padding=1)(net.input("x", (2, 4, 5, 6))))
    net.outputs(pre=pre, y=lm.layers.Activation(kind)(pre))
    rng = np.random.default_rng(9)
    for name in ("running_mean", "running_var", "weight", "bias"):
        bn.params[name].assign(rng.uniform(0.5, 1.5, 3) if name == "running_var" else rng.standard_normal(3))
    X = rng.standard_normal((2, 2, 4, 5, 6)).astype(np.float32)
    assert net.scheduler.plan(False, ("y",)).fused == {"bn": (kind, 0.01)}
    before = net.run({"x": X}, ["pre"])["pre"]
    # (elu's alpha is the layer's slope, 0.01 by default)
    want = np.maximum(before, 0) if kind == "relu" else np.where(before > 0, before, 0.01 * np.expm1(before))
    np.testing.assert_allclose(net.run({"x": X}, ["y"])["y"], want, rtol=1e-6, atol=1e-7)


def test_concat_channels():
    net = lm.Network()
    a, b = net.input("a", (2, 3, 4)), net.input("b", (3, 3, 4))
    y = ConcatChannels()(a, b)
    probe = add_probe_cost(net, y)
    net.astype("float64")
    rng = np.random.default_rng(6)
    feeds = {"a": rng.standard_normal((2, 2, 3, 4)), "b": rng.standard_normal((2, 3, 3, 4)),
             probe: probe_feed(net, probe, 2)}
    check_gradients(net, feeds)
    net.outputs(y=y)
    np.testing.assert_array_equal(net.run({"a": feeds["a"], "b": feeds["b"]}, outputs=["y"])["y"],
                                  np.concatenate([feeds["a"], feeds["b"]], axis=1))
    with pytest.raises(lm.GraphError, match="every input needs the spatial size"):
        ConcatChannels()(a, net.input("c", (1, 3, 5)))


INDEXED_POOLS = [(t, shape, kw) for t, shape, kw in POOLS if "Max" in t.__name__
                 and not (isinstance(kw.get("padding"), tuple) and isinstance(kw["padding"][0], tuple))]


@pytest.mark.parametrize("case", INDEXED_POOLS, ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(INDEXED_POOLS)])
@pytest.mark.parametrize("backend", [lm.CPUBackend, ReferenceBackend], ids=["cpu", "reference"])
def test_max_pool_indices_match_pytorch(case, backend):
    """return_indices: each maximum's row-major position in its sample's channel plane, as
    PyTorch's return_indices (of tied values the first in the window), in inference and in a
    training forward (OpenCL: test_opencl.py)."""
    import torch
    layer_type, shape, kw = case
    net = lm.Network(backend=backend())
    x = net.input("x", shape)
    y, indices = layer_type(**kw, return_indices=True)(x)
    assert indices.name.endswith(".indices") and indices.spec.kind == "int32"
    net.outputs(y=y, indices=indices)
    X = np.random.default_rng(7).integers(-3, 4, (2,) + shape).astype(np.float32)  # many ties
    want_y, want_i = getattr(torch.nn, layer_type.__name__)(**kw, return_indices=True)(torch.from_numpy(X))
    for got in (net.run({"x": X}), net.forward({"x": X}, training=True)):
        np.testing.assert_array_equal(got["y"], want_y.numpy())
        np.testing.assert_array_equal(got["indices"], want_i.numpy())


@pytest.mark.parametrize("case", INDEXED_POOLS[:3],
                         ids=[f"{c[0].__name__}-{i}" for i, c in enumerate(INDEXED_POOLS[:3])])
def test_max_pool_gradients_with_indices_asked_for(case):
    layer_type, shape, kw = case
    net = lm.Network()
    y, indices = layer_type(**kw, return_indices=True)(net.input("x", shape))
    probe = add_probe_cost(net, y)
    net.outputs(indices=indices)
    net.astype("float64")
    rng = np.random.default_rng(0)
    check_gradients(net, {"x": rng.standard_normal((2,) + shape), probe: probe_feed(net, probe, 2)})


def test_max_pool_indices_round_trip_and_stay_out_of_a_convolution(tmp_path):
    """A model file keeps return_indices; a convolution never absorbs a pool whose positions are
    asked for (it writes maxima only)."""
    net = lm.Network()
    x = net.input("x", (2, 8, 8))
    conv = Conv2d(2, 4, 3, padding=1, name="conv")
    y, indices = MaxPool2d(2, return_indices=True, name="pool")(lm.layers.Activation("relu")(conv(x)))
    net.outputs(y=y, indices=indices)
    X = np.random.default_rng(8).standard_normal((3, 2, 8, 8)).astype(np.float32)
    out = net.run({"x": X})
    assert not net.scheduler.plan(False, ("y", "indices")).pooled
    lm.save(net, tmp_path / "m.lamina")
    again = lm.load(tmp_path / "m.lamina").run({"x": X})
    for name in ("y", "indices"):
        np.testing.assert_array_equal(again[name], out[name])
    assert again["indices"].dtype == np.int32


@pytest.mark.parametrize("window", [((1, 3, 3), (1, 2, 2), (0, 1, 1), (1, 1, 1)),
                                    ((2, 3, 2), (1, 2, 3), (1, 1, 0), (1, 2, 1)),
                                    ((1, 2, 3), (1, 1, 2), (0, 1, 1), (1, 2, 2))],
                         ids=["3x3-stride-2-padded", "3-d-dilated", "dilated-2-d"])
def test_padded_max_pools_choose_as_the_generic_rule(window):
    """Padded windows: the rows of windows inside (pools.h) and the windows at the edges (tap by
    tap with bounds) follow one rule: the first tap inside starts, only a greater value replaces
    (of ties the first wins, a NaN stays only as the first tap inside), positions as the winners'."""
    (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw) = window
    rng = np.random.default_rng(11)
    x = rng.integers(0, 3, (3, 5, 9, 17)).astype(np.float32)
    x[0, 0, 0, 0], x[1, 2, 4, 7], x[2, 1, 3, 16] = np.nan, np.nan, np.nan
    out_size = [(n + 2 * p - d * (k - 1) - 1) // s + 1 for n, k, s, p, d in
                zip(x.shape[1:], (kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw))]
    want, want_at = np.zeros([3] + out_size, np.float32), np.zeros([3] + out_size, np.int32)
    for q, od, oh, ow in np.ndindex(*want.shape):
        best, at = None, -1
        for a, b, e in np.ndindex(kd, kh, kw):
            i = (od * sd - pd + a * dd, oh * sh - ph + b * dh, ow * sw - pw + e * dw)
            if all(0 <= j < n for j, n in zip(i, x.shape[1:])) and (best is None or x[(q,) + i] > best):
                best, at = x[(q,) + i], np.ravel_multi_index(i, x.shape[1:])
        want[q, od, oh, ow], want_at[q, od, oh, ow] = best, at
    out, argmax = np.zeros_like(want), np.zeros((3, want[0].size), np.int32)
    geometry = ((kd, kh, kw), (sd, sh, sw), (pd, ph, pw), (dd, dh, dw))
    for positions in (argmax, None):
        lm.CPUBackend().max_pool(x[:, None], out[:, None], positions, geometry)
        np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(argmax.reshape(want.shape), want_at)
