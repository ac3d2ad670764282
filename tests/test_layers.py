"""Every layer: a float64 central-difference gradient check over its inputs and parameters, and
its forward against a plain numpy formula."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import (Activation, Add, BCEWithLogits, Bias, Concat, Dropout, Linear, Multiply, PReLU, Reshape,
                           Scale, Slice, Broadcast, Transpose, SoftmaxCrossEntropy, SquareError)
from lamina.testing import GradientCheckError, add_probe_cost, check_gradients, probe_feed

from helpers import rand

N = 5


def probed(build, in_sizes, batch=N, seed=0, backend=None):
    """A float64 network: inputs of the given sizes → build(...) → a probe cost. Returns the
    network, its feeds and the layer's output value."""
    net = lm.Network(backend=backend)
    xs = [net.input(f"x{i}", size) for i, size in enumerate(in_sizes)]
    out = build(*xs)
    probe = add_probe_cost(net, out)
    net.astype("float64")
    rng = np.random.default_rng(seed)
    feeds = {f"x{i}": rand(rng, batch, *np.atleast_1d(size)) for i, size in enumerate(in_sizes)}
    feeds[probe] = probe_feed(net, probe, batch, seed)
    return net, feeds, out


from lamina.backends.base import ALL_ACTIVATIONS, INPUT_GRAD_ACTIVATIONS  # noqa: E402

ACTS = list(ALL_ACTIVATIONS)
POSITIVE_DOMAIN = ("sqrt", "log", "reciprocal")  # tested on positive inputs (NaN or a pole elsewhere)
# Linear applies these in place (its outputs take either sign: the positive-domain ones are
# checked on their own)
FUSED_ACTS = [a for a in ACTS if a not in INPUT_GRAD_ACTIVATIONS and a not in POSITIVE_DOMAIN]


@pytest.mark.parametrize("activation", FUSED_ACTS)
def test_linear_gradients(activation):
    net, feeds, _ = probed(lambda x: Linear(4, 3, activation=activation, slope=0.2)(x), [4])
    assert check_gradients(net, feeds) == N * 4 + 12 + 3


@pytest.mark.parametrize("bias", [True, False])
def test_linear_several_inputs_gradients(bias):
    net, feeds, _ = probed(lambda a, b: Linear([3, 5], 4, bias=bias, activation="tanh")(a, b), [3, 5])
    check_gradients(net, feeds)


def test_linear_matches_numpy():
    rng = np.random.default_rng(0)
    net = lm.Network()
    a, b = net.input("a", 6), net.input("b", 2)
    fc = Linear([6, 2], 7, activation="sigmoid")
    net.outputs(y=fc(a, b))
    A, B = rand(rng, 9, 6, dtype=np.float32), rand(rng, 9, 2, dtype=np.float32)
    z = A @ fc.params["weight_0"].value.T + B @ fc.params["weight_1"].value.T + fc.bias.value
    np.testing.assert_allclose(net.run({"a": A, "b": B})["y"], 1 / (1 + np.exp(-z)), rtol=1e-5)


def test_add_gradients_and_numpy():
    net, feeds, out = probed(lambda a, b, c: Add(activation="relu")(a, b, c), [4, 4, 4])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_allclose(net.scheduler.current.values[out.name],
                               np.maximum(feeds["x0"] + feeds["x1"] + feeds["x2"], 0))


def test_concat_gradients_and_numpy():
    net, feeds, out = probed(lambda a, b, c: Concat()(a, b, c), [2, 5, 1])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_array_equal(net.scheduler.current.values[out.name],
                                  np.concatenate([feeds["x0"], feeds["x1"], feeds["x2"]], axis=1))


@pytest.mark.parametrize("activation", ACTS)
def test_activation_gradients(activation):
    net, feeds, _ = probed(lambda x: Activation(activation, slope=0.3)(x), [6])
    if activation in POSITIVE_DOMAIN:
        feeds["x0"] = np.abs(feeds["x0"]) + 0.5
    check_gradients(net, feeds)


def test_dropout_gradients_and_statistics():
    net, feeds, out = probed(lambda x: Dropout(0.4)(x), [50], batch=40)
    check_gradients(net, feeds)
    net.forward(feeds)
    y = np.array(net.scheduler.current.values[out.name])
    kept = y != 0
    assert 0.5 < kept.mean() < 0.7  # keep probability 0.6 over 2000 elements
    np.testing.assert_allclose(y[kept], feeds["x0"][kept] / 0.6)


def test_dropout_is_identity_in_inference():
    net = lm.Network()
    x = net.input("x", 8)
    net.outputs(y=Dropout(0.5)(x))
    X = np.arange(16, dtype=np.float32).reshape(2, 8)
    np.testing.assert_array_equal(net.run({"x": X})["y"], X)


def test_scale_gradients_and_numpy():
    net, feeds, out = probed(lambda x: Scale(-2.5)(x), [3])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_allclose(net.scheduler.current.values[out.name], -2.5 * feeds["x0"])


def cost_net(cost, classes=4, weighted=False, target="float"):
    net = lm.Network()
    x = net.input("x", classes)
    h = Linear(classes, classes, activation="tanh")(x)  # so parameters are checked through the cost
    t = net.input("t", () if target == "int32" else classes, dtype=target)
    ins = [h, t] + ([net.input("w", ())] if weighted else [])
    net.outputs(loss=cost()(*ins))
    return net.astype("float64")


def cost_feeds(rng, classes=4, weighted=False, target="float", batch=6):
    feeds = {"x": rand(rng, batch, classes)}
    feeds["t"] = (rng.integers(0, classes, batch).astype(np.int32) if target == "int32"
                  else rng.uniform(0, 1, (batch, classes)))
    if weighted:
        feeds["w"] = rng.uniform(0.5, 2, batch)
    return feeds


@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy_gradients_and_numpy(weighted):
    rng = np.random.default_rng(3)
    net = cost_net(SoftmaxCrossEntropy, weighted=weighted, target="int32")
    feeds = cost_feeds(rng, weighted=weighted, target="int32")
    check_gradients(net, feeds)
    h = net.layers[0]
    z = np.tanh(feeds["x"] @ h.weight.value.T + h.bias.value)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    cost = -logp[np.arange(6), feeds["t"]] * (feeds["w"] if weighted else 1)
    np.testing.assert_allclose(net.run(feeds)["loss"], cost, rtol=1e-12)


@pytest.mark.parametrize("cost", [SquareError, BCEWithLogits])
@pytest.mark.parametrize("weighted", [False, True])
def test_pair_cost_gradients(cost, weighted):
    rng = np.random.default_rng(4)
    net = cost_net(cost, weighted=weighted)
    feeds = cost_feeds(rng, weighted=weighted)
    check_gradients(net, feeds)  # includes the gradient with respect to the target 't'


def test_pair_costs_match_numpy():
    rng = np.random.default_rng(5)
    x, t = rand(rng, 6, 4), rng.uniform(0, 1, (6, 4))
    for cost, formula in [(SquareError, ((x - t) ** 2).sum(1)),
                          (BCEWithLogits, (-(t * np.log(1 / (1 + np.exp(-x))) + (1 - t) * np.log(1 - 1 / (1 + np.exp(-x))))).sum(1))]:
        net = lm.Network(dtype="float64")
        a, b = net.input("x", 4), net.input("t", 4)
        net.outputs(c=cost()(a, b))
        np.testing.assert_allclose(net.run({"x": x, "t": t})["c"], formula, rtol=1e-12)


def test_gradient_check_catches_a_wrong_gradient():
    """The checker fails a layer whose backward is off by a factor, or has the wrong sign."""
    class WrongScale(Scale):
        kind = "wrong_scale_test"

        def backward(self, ctx):
            dx = ctx.input_grad(0)
            ctx.be.axpby(-self.factor, ctx.grad_output, dx.beta, dx.array)

    net, feeds, _ = probed(lambda x: WrongScale(1.5)(x), [3])
    with pytest.raises(GradientCheckError, match="input x0"):
        check_gradients(net, feeds)


def test_gradient_check_catches_missing_accumulation():
    """A layer that overwrites a parameter gradient instead of adding fails the second-backward check."""
    class Overwriting(Linear):
        def backward(self, ctx):
            p = self.params["bias"]
            p.drop_grad()  # pretend every backward is the first
            super().backward(ctx)

    net, feeds, _ = probed(lambda x: Overwriting(3, 2)(x), [3])
    with pytest.raises(GradientCheckError, match="must double"):
        check_gradients(net, feeds)


def numpy_activation(kind, x, slope):
    """The activations' formulas, softmax along the last axis."""
    import math
    if kind == "softmax":
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)
    if kind == "log_softmax":
        return x - np.log(np.exp(x).sum(-1, keepdims=True))
    erf = np.vectorize(math.erf)
    with np.errstate(all="ignore"):  # (every formula is evaluated; some are NaN outside their domain)
        return _formulas(x, slope, erf)[kind]


def _formulas(x, slope, erf):
    return {"linear": x, "sigmoid": 1 / (1 + np.exp(-x)), "tanh": np.tanh(x), "relu": np.maximum(x, 0),
            "leaky_relu": np.where(x < 0, slope * x, x), "exponential": np.exp(x),
            "softrelu": np.log1p(np.exp(x)), "elu": np.where(x < 0, slope * np.expm1(x), x),
            "selu": 1.0507009873554805 * np.where(x < 0, 1.6732632423543772 * np.expm1(x), x),
            "softsign": x / (1 + np.abs(x)), "hard_sigmoid": np.clip(slope * x + 0.5, 0, 1),
            "gelu": 0.5 * x * (1 + erf(x / np.sqrt(2))), "hard_swish": x * np.clip(x / 6 + 0.5, 0, 1),
            "gelu_tanh": 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))),
            "bounded_relu": np.clip(x, 0, slope), "sqrt": np.sqrt(x), "reciprocal": 1 / x, "log": np.log(x),
            "abs": np.abs(x), "erf": erf(x)}


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 5)])
@pytest.mark.parametrize("activation", ACTS)
def test_activation_with_several_axes_per_sample(activation, shape):
    """Samples of several axes: gradients, and the numpy formula (softmax along the last axis)
    on every backend the tests have."""
    from conftest import OPENCL_DEVICES
    net, feeds, out = probed(lambda x: Activation(activation, slope=0.3)(x), [shape], batch=3)
    if activation in POSITIVE_DOMAIN:
        feeds["x0"] = np.abs(feeds["x0"]) + 0.5
    check_gradients(net, feeds)
    single = lm.Network()
    single.outputs(y=Activation(activation, slope=0.3)(single.input("x", shape)))
    x = feeds["x0"].astype(np.float32)
    expected = numpy_activation(activation, x.astype(np.float64), 0.3)
    devices = ["cpu"] + (["opencl"] if OPENCL_DEVICES else [])
    for device in devices:
        np.testing.assert_allclose(single.to(device).run({"x": x})["y"], expected, rtol=2e-5, atol=1e-6,
                                   err_msg=device)


def test_reshape_gradients_and_numpy():
    net, feeds, out = probed(lambda x: Reshape((3, 2, 2))(x), [(2, 6)])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_array_equal(net.scheduler.current.values[out.name], feeds["x0"].reshape(N, 3, 2, 2))


def test_bias_gradients_and_numpy():
    layer = Bias((2, 3))
    net, feeds, out = probed(lambda x: layer(x), [(2, 3)])
    layer.params["bias"].assign(np.arange(6.0).reshape(2, 3))
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_allclose(net.scheduler.current.values[out.name], feeds["x0"] + np.arange(6.0).reshape(2, 3))


@pytest.mark.parametrize("shape,start,stop,squeeze", [((6,), 2, 5, False), ((4, 3, 2), 1, 3, False),
                                                      ((2, 5), 1, 2, True), ((3,), 2, 3, True)])
def test_slice_gradients_and_numpy(shape, start, stop, squeeze):
    net, feeds, out = probed(lambda x: Slice(start, stop, squeeze=squeeze)(x), [shape])
    check_gradients(net, feeds)
    net.forward(feeds)
    want = feeds["x0"][:, start:stop]
    want = want.reshape((N,) + (shape[1:] or (1,))) if squeeze else want
    np.testing.assert_array_equal(net.scheduler.current.values[out.name], want)


@pytest.mark.parametrize("shape,slopes", [((6,), 6), ((3, 4, 2), 3), ((3, 4), 1)])
def test_prelu_gradients_and_numpy(shape, slopes):
    layer = PReLU(slopes)
    net, feeds, out = probed(lambda x: layer(x), [shape])
    a = np.linspace(-0.5, 0.8, slopes)
    layer.params["weight"].assign(a)
    feeds["x0"][np.abs(feeds["x0"]) < 1e-3] = 0.5  # away from the kink at 0 for central differences
    check_gradients(net, feeds)
    net.forward(feeds)
    x = feeds["x0"]
    per = a.reshape((1, slopes) + (1,) * (len(shape) - 1)) if slopes > 1 else a[0]
    np.testing.assert_allclose(net.scheduler.current.values[out.name], np.maximum(x, 0) + per * np.minimum(x, 0))


def test_prelu_refuses_a_channel_count_it_lacks():
    net = lm.Network()
    with pytest.raises(ValueError, match="must have 4 channels"):
        PReLU(4)(net.input("x", (3, 5)))


@pytest.mark.parametrize("shape,target", [((3, 1, 1), (3, 4, 2)), ((1, 4, 2), (3, 4, 2)), ((3, 1, 2), (3, 4, 2)),
                                          ((1,), (5,)), ((2, 3), (2, 3))])
def test_broadcast_gradients_and_numpy(shape, target):
    net, feeds, out = probed(lambda x: Broadcast(target)(x), [shape])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_array_equal(net.scheduler.current.values[out.name],
                                  np.broadcast_to(feeds["x0"], (N,) + target))


@pytest.mark.parametrize("shape,perm", [((3, 4), (1, 0)), ((2, 3, 4), (2, 0, 1)), ((2, 3, 4), (0, 2, 1)),
                                        ((5,), (0,))])
def test_transpose_gradients_and_numpy(shape, perm):
    net, feeds, out = probed(lambda x: Transpose(perm)(x), [shape])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_array_equal(net.scheduler.current.values[out.name],
                                  feeds["x0"].transpose((0,) + tuple(p + 1 for p in perm)))


def test_transpose_refuses_what_it_cannot_take():
    net = lm.Network()
    with pytest.raises(ValueError, match="must order the axes"):
        Transpose((0, 0))
    with pytest.raises(ValueError, match="must have 2 axes per sample"):
        Transpose((1, 0))(net.input("x", (2, 3, 4)))


def test_broadcast_refuses_what_it_cannot_take():
    net = lm.Network()
    with pytest.raises(ValueError, match="one run of axes to repeat"):
        Broadcast((3, 4, 2))(net.input("a", (1, 4, 1)))
    with pytest.raises(ValueError, match="does not broadcast"):
        Broadcast((3, 4))(net.input("b", (2, 4)))


def test_slice_refuses_what_it_cannot_take():
    net = lm.Network()
    x = net.input("x", (3, 2))
    with pytest.raises(ValueError, match="at least 4 entries along its first axis"):
        Slice(1, 4)(x)
    with pytest.raises(ValueError, match="0 <= start < stop"):
        Slice(2, 2)
    with pytest.raises(ValueError, match="single index"):
        Slice(0, 2, squeeze=True)


def test_multiply_gradients_and_numpy():
    net, feeds, out = probed(lambda a, b: Multiply()(a, b), [(3, 2), (3, 2)])
    check_gradients(net, feeds)
    net.forward(feeds)
    np.testing.assert_allclose(net.scheduler.current.values[out.name], feeds["x0"] * feeds["x1"])


def random_fan_out_graph(seed, width=3):
    """A float64 network of 6-9 layers over two inputs, each reading one to three of the values
    made before it, so most values feed two or three consumers (some the same consumer twice);
    three probe costs read values from different depths. Layers: Linear (one or several
    inputs), Add, Multiply, Concat (+ Linear back to width), Activation, Scale."""
    rng = np.random.default_rng(seed)
    net = lm.Network()
    values = [net.input("x0", width), net.input("x1", width)]
    for _ in range(rng.integers(6, 10)):
        kind = rng.choice(["linear", "linear2", "add", "multiply", "concat", "activation", "scale"])
        picks = [values[i] for i in rng.integers(0, len(values), size=3)]  # repeats allowed: fan-out
        if kind == "linear":
            out = Linear(width, width, activation=str(rng.choice(["tanh", "sigmoid", "linear"])))(picks[0])
        elif kind == "linear2":
            out = Linear([width, width], width)(picks[0], picks[1])
        elif kind == "add":
            out = Add()(*picks[:int(rng.integers(2, 4))])
        elif kind == "multiply":
            out = Multiply()(picks[0], picks[1])
        elif kind == "concat":
            out = Linear(2 * width, width, activation="tanh")(Concat()(picks[0], picks[1]))
        elif kind == "activation":
            out = Activation(str(rng.choice(["tanh", "sigmoid", "softrelu", "elu"])))(picks[0])
        else:
            out = Scale(float(rng.uniform(-2, 2)))(picks[0])
        values.append(out)
    probes = [add_probe_cost(net, v) for v in {v.name: v for v in values[-3:] + [values[2]]}.values()]
    net.astype("float64")
    feeds = {f"x{i}": rand(rng, N, width) for i in range(2)}
    for i, probe in enumerate(probes):
        feeds[probe] = probe_feed(net, probe, N, seed + i)
    return net, feeds


@pytest.mark.parametrize("seed", range(12))
def test_random_graphs_with_fan_out_have_exact_gradients(seed):
    """Values read by several layers (or twice by one) must get the sum of their consumers'
    gradients: a scheduler that overwrote instead of adding fails here by the missing terms."""
    net, feeds = random_fan_out_graph(seed)
    readers = {}
    for node in net.nodes:
        for v in node.input_names:
            readers[v] = readers.get(v, 0) + 1
    assert max(readers.values()) >= 2  # the graph has fan-out
    check_gradients(net, feeds)


def test_a_parameter_backward_did_not_reach_has_a_zero_gradient():
    """A layer on a branch no cost reads gets no gradient: its dense gradient is zeros, not
    whatever the buffer held (a gradient of an earlier step, or uninitialised memory)."""
    net = lm.Network()
    x = net.input("x", 3)
    used, unused = Linear(3, 2, name="used"), Linear(3, 2, name="unused")
    unused(x)
    add_probe_cost(net, used(x))
    feeds = {"x": rand(np.random.default_rng(0), 4, 3, dtype=np.float32)}
    feeds["used:probe"] = probe_feed(net, "used:probe", 4)
    net.forward(feeds)
    net.backward()
    p = net.layer("unused").weight
    p.grad[...] = 7.0  # what an earlier use of the buffer left
    np.testing.assert_array_equal(p.dense_grad(net.backend), np.zeros((2, 3), np.float32))
    assert np.abs(net.layer("used").weight.dense_grad(net.backend)).max() > 0


@pytest.mark.parametrize("activation", ["gelu", "erf"])
def test_erf_activations_far_from_zero(activation):
    """Inputs of large magnitude (where erfc is far below float32's smallest normal number) give
    the formula's values (GELU x or 0, erf ±1), NaN stays NaN, and the computation keeps to normal
    numbers (a subnormal product made GELU several times slower)."""
    x = np.array([[-1e4, -50.0, -13.0, -9.5, 9.5, 13.0, 50.0, 1e4, np.nan]], np.float32)
    net = lm.Network()
    net.outputs(y=Activation(activation)(net.input("x", x.shape[1:])))
    got = net.run({"x": x})["y"]
    with np.errstate(all="ignore"):
        want = numpy_activation(activation, x.astype(np.float64), 0.01)
    np.testing.assert_allclose(got[:, :-1], want[:, :-1], rtol=1e-6, atol=1e-30)
    assert np.isnan(got[0, -1])
