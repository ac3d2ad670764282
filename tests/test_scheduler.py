"""The scheduler: gradients of values used by several layers, shared weights, frozen parameters,
update callbacks, buffer reuse."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import Activation, Add, Linear, SquareError
from lamina.testing import check_gradients

from helpers import rand


def test_fan_out_gradient_is_the_sum_of_all_consumers():
    """x feeds two ReLU layers and a fully-connected layer: dL/dx is the sum of the three."""
    rng = np.random.default_rng(0)
    net = lm.Network()
    x = net.input("x", 4)
    r1, r2 = Activation("relu")(x), Activation("relu")(x)
    fc = Linear(4, 4)
    f = fc(x)
    t1, t2, t3 = net.input("t1", 4), net.input("t2", 4), net.input("t3", 4)
    net.outputs(c1=SquareError()(r1, t1), c2=SquareError()(r2, t2), c3=SquareError()(f, t3))
    net.astype("float64")
    feeds = {k: rand(rng, 6, 4) for k in ["x", "t1", "t2", "t3"]}
    check_gradients(net, feeds, inputs=["x"])

    net.values["x"].requires_grad = True
    net.forward(feeds)
    net.backward()
    X = feeds["x"]
    relu = np.maximum(X, 0)
    d1 = 2 * (relu - feeds["t1"]) * (X > 0) / 6
    d2 = 2 * (relu - feeds["t2"]) * (X > 0) / 6
    d3 = 2 * (X @ fc.weight.value.T + fc.bias.value - feeds["t3"]) / 6 @ fc.weight.value
    np.testing.assert_allclose(net.grad("x"), d1 + d2 + d3, rtol=1e-12)
    # the first consumer in backward order overwrote, the later ones added
    betas = [net.scheduler.plan(True, tuple(net.output_values)).in_betas[n.name][0]
             for n in reversed(net.scheduler.order) if n.name in ("activation0", "activation1", "linear0")]
    assert betas == [0.0, 1.0, 1.0]


def test_one_layer_consuming_a_value_twice():
    rng = np.random.default_rng(1)
    net = lm.Network()
    x = net.input("x", 3)
    s = Add()(x, x)                  # d/dx = 2
    y = Linear([3, 3], 2)(s, x)      # the same value in two slots of one layer
    net.outputs(c=SquareError()(y, net.input("t", 2)))
    net.astype("float64")
    feeds = {"x": rand(rng, 4, 3), "t": rand(rng, 4, 2)}
    check_gradients(net, feeds, inputs=["x"])


def shared_weight_net():
    net = lm.Network()
    x = net.input("x", 3)
    a = Linear(3, 3, activation="tanh", name="a")
    b = Linear(3, 3, activation="tanh", name="b")
    b.tie("weight", a.weight)
    h = b(a(x))
    h2 = a(h)                        # the same layer applied twice: a second node, same weights
    net.outputs(c=SquareError()(h2, net.input("t", 3)))
    return net, a, b


def test_shared_weights_accumulate():
    rng = np.random.default_rng(2)
    net, a, b = shared_weight_net()
    assert len(net.parameters()) == 3  # a.weight (shared by three nodes), a.bias, b.bias
    net.astype("float64")
    check_gradients(net, {"x": rand(rng, 5, 3), "t": rand(rng, 5, 3)})


def test_update_callbacks_fire_once_after_the_last_user():
    rng = np.random.default_rng(3)
    net, a, b = shared_weight_net()
    events = []
    for layer in net.layers:
        original = layer.backward

        def traced(ctx, original=original):
            original(ctx)
            events.append(("backward", ctx.node.name))
        layer.backward = traced
    feeds = {"x": rand(rng, 5, 3, dtype=np.float32), "t": rand(rng, 5, 3, dtype=np.float32)}
    for step in range(2):
        events.clear()
        net.forward(feeds)
        net.backward(on_ready=lambda p: events.append(("update", p.name)))
        updates = [e for e in events if e[0] == "update"]
        assert sorted(updates) == sorted(("update", p.name) for p in net.parameters())
        # a.weight is used by nodes a, b and a#1; backward runs from the cost back to a
        order = [e[1] for e in events if e[0] == "backward"]
        assert order == ["square_error0", "a#1", "b", "a"]
        assert events.index(("update", "a.weight")) == events.index(("backward", "a")) + 1
        assert events.index(("update", "b.bias")) == events.index(("backward", "b")) + 1
        net.zero_grad()


def test_frozen_parameters_get_no_gradient_and_no_update():
    rng = np.random.default_rng(4)
    net = lm.Network()
    x = net.input("x", 3)
    first, second = Linear(3, 4, activation="tanh"), Linear(4, 2)
    net.outputs(c=SquareError()(second(first(x)), net.input("t", 2)))
    net.freeze(first.name)
    before = first.weight.value.copy(), second.weight.value.copy()
    opt = lm.optim.SGD(net, lr=0.1)
    fired = []
    feeds = {"x": rand(rng, 8, 3, dtype=np.float32), "t": rand(rng, 8, 2, dtype=np.float32)}
    net.forward(feeds)
    opt.begin_step()
    net.backward(on_ready=lambda p: (fired.append(p.name), opt.update(p)))
    assert sorted(fired) == ["linear1.bias", "linear1.weight"]
    assert first.weight.grad is None and first.bias.grad is None
    np.testing.assert_array_equal(first.weight.value, before[0])
    assert not np.array_equal(second.weight.value, before[1])
    # gradients still flow through the frozen layer to the input
    net.astype("float64")
    check_gradients(net, {k: v.astype(np.float64) for k, v in feeds.items()}, inputs=["x"])


def test_a_second_backward_without_update_doubles_parameter_gradients():
    rng = np.random.default_rng(5)
    net = lm.Network(dtype="float64")
    x = net.input("x", 3)
    fc = Linear(3, 2)
    net.outputs(c=SquareError()(fc(x), net.input("t", 2)))
    net.astype("float64")
    feeds = {"x": rand(rng, 4, 3), "t": rand(rng, 4, 2)}
    net.forward(feeds)
    net.backward()
    once = fc.weight.grad.copy()
    net.forward(feeds)
    net.backward()
    np.testing.assert_allclose(fc.weight.grad, 2 * once, rtol=1e-14)
    net.zero_grad()
    net.forward(feeds)
    net.backward()
    np.testing.assert_allclose(fc.weight.grad, once, rtol=1e-14)


def deep_chain(depth=8, width=64):
    net = lm.Network()
    h = x = net.input("x", width)
    for _ in range(depth):
        h = Linear(width, width, activation="relu")(h)
    net.outputs(y=h, c=SquareError()(h, net.input("t", width)))
    return net, x


def test_buffers_are_allocated_once_and_reused_across_steps():
    rng = np.random.default_rng(6)
    net, _ = deep_chain()
    feeds = {"x": rand(rng, 16, 64, dtype=np.float32), "t": rand(rng, 16, 64, dtype=np.float32)}
    opt = lm.optim.SGD(net, lr=0.01)
    net.train_step(feeds, opt)
    b = net.scheduler.current
    ids = {k: id(v) for k, v in b.values.items() if k not in feeds} | {k: id(v) for k, v in b.grads.items()}
    grads = [id(p.grad) for p in net.parameters()]
    net.train_step(feeds, opt)
    b2 = net.scheduler.current
    assert b2 is b
    assert ids == {k: id(v) for k, v in b.values.items() if k not in feeds} | {k: id(v) for k, v in b.grads.items()}
    assert grads == [id(p.grad) for p in net.parameters()]


def test_inference_reuses_buffers_after_their_last_consumer():
    rng = np.random.default_rng(7)
    net, _ = deep_chain(depth=8)
    X = rand(rng, 32, 64, dtype=np.float32)
    out = net.run({"x": X}, outputs=["y"])["y"]
    sched = net.scheduler
    plan = sched.plan(False, ("y",))
    with sched.borrowed(plan) as b:  # the bindings that run used, returned to the pool
        distinct = {b.values[n.output].__array_interface__["data"][0] for n in plan.nodes}
    assert len(distinct) == 2  # a chain needs only two alternating buffers, not eight
    # same answer as the training forward, which keeps every activation
    feeds = {"x": X, "t": np.zeros((32, 64), np.float32)}
    np.testing.assert_array_equal(net.forward(feeds, training=False)["y"], out)
    # outputs are copies: the next run does not change what the caller holds
    kept = out.copy()
    net.run({"x": rand(rng, 32, 64, dtype=np.float32)}, outputs=["y"])
    np.testing.assert_array_equal(out, kept)


def fusion_net():
    """conv -> relu -> pool (fusable); linear -> tanh, with the linear's output also an output
    (not fusable); add -> relu -> relu (the first fuses into the add, the second reads an
    activation); a linear read by two activations (not fusable)."""
    net = lm.Network()
    x = net.input("x", (2, 6, 6))
    c = lm.layers.MaxPool2d(2)(Activation("relu", name="conv_relu")(lm.layers.Conv2d(2, 3, 3, padding=1,
                                                                                      name="conv")(x)))
    flat = lm.layers.Reshape((27,), name="flat")(c)
    lin = Linear(27, 5, name="lin")(flat)
    shared = Linear(27, 5, name="shared")(flat)
    added = Add(name="add")(Activation("tanh", name="lin_tanh")(lin), Activation("sigmoid")(shared))
    twice = Activation("relu", name="second")(Activation("relu", name="first")(added))
    net.outputs(y=twice, lin=lin, z=Activation("leaky_relu", slope=0.2)(shared))
    return net


def test_inference_runs_an_activation_inside_the_layer_before_it():
    net = fusion_net()
    plan = net.scheduler.plan(False, ("y", "lin", "z"))
    assert plan.fused == {"conv": ("relu", 0.01), "add": ("relu", 0.01)}
    pooled = net.nodes[2].output  # (the reshape, a view, reads the pool's output alone)
    assert plan.aliases == {"conv_relu": "conv", "first": "add", "flat": pooled}
    X = np.random.default_rng(8).standard_normal((4, 2, 6, 6)).astype(np.float32)
    got = net.run({"x": X})
    want = net.forward({"x": X}, training=True)  # training never fuses
    for name in ("y", "lin", "z"):
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    # the fused activation's output is its input's buffer, and the pool reads it
    with net.scheduler.borrowed(plan) as b:
        address = {k: b.values[k].__array_interface__["data"][0] for k in ("conv_relu", "conv")}
        assert address["conv_relu"] == address["conv"]
        assert [n.name for n, _ in b.contexts if n.name in ("conv_relu", "first")] == []
        # the reshape's output is the pool's buffer in its own shape, and the reshape does not run
        assert b.values["flat"].__array_interface__["data"][0] == b.values[pooled].__array_interface__["data"][0]
        assert b.values["flat"].shape == (4, 27) and "flat" not in [n.name for n, _ in b.contexts]
    # an output that asks for the pre-activation value keeps the activation a node of its own
    plan = net.scheduler.plan(False, ("y", "lin"))
    assert "lin" not in plan.fused
    assert net.scheduler.plan(True, ("y",)).fused == {}


def test_a_reshape_aliases_its_input_only_where_nothing_else_reads_it():
    """A view's input read by another node, or asked for as an output, keeps a buffer of its own;
    answers are those of the training forward (which copies) either way (to the rounding of the
    inference's products from packed weights)."""
    net = lm.Network()
    x = net.input("x", (6,))
    h = Linear(6, 6, name="h")(x)
    shared = lm.layers.Reshape((2, 3), name="shared")(h)  # h also feeds "tanh": no alias
    again = Linear(6, 4, name="again")(Activation("tanh", name="tanh")(h))
    lone = lm.layers.Reshape((3, 2), name="lone")(Linear(6, 6, name="k")(x))  # k's one reader
    last = Linear(6, 3, name="last")(lm.layers.Reshape((6,), name="back")(lone))
    net.outputs(shared=shared, again=again, lone=lone, last=last)
    X = np.random.default_rng(9).standard_normal((5, 6)).astype(np.float32)
    want = net.forward({"x": X}, training=True)
    plan = net.scheduler.plan(False, ("shared", "again", "lone", "last"))
    assert plan.aliases == {"lone": "k"}  # "back" reads "lone", which is asked for
    got = net.run({"x": X})
    for name in ("shared", "again", "lone", "last"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-6, err_msg=name)
    assert net.scheduler.plan(False, ("last",)).aliases == {"lone": "k", "back": "lone"}
    np.testing.assert_allclose(net.run({"x": X}, outputs=["last"])["last"], want["last"], rtol=1e-6, atol=1e-6)
    assert net.scheduler.plan(False, ("lone",)).aliases == {"lone": "k"}


def test_inference_without_labels_computes_what_it_can():
    net, _ = deep_chain(depth=2, width=4)
    result = net.run({"x": np.ones((3, 4), np.float32)})
    assert list(result) == ["y"]


def test_train_step_learns():
    """A small classifier's loss falls by more than half in 60 Adam steps (a behavioural check
    of forward, backward, callbacks and the optimizer together)."""
    lm.manual_seed(0)
    rng = np.random.default_rng(8)
    X = rng.standard_normal((128, 10)).astype(np.float32)
    Y = (X[:, 0] + X[:, 1] > 0).astype(np.int32)
    net = lm.Network()
    x, y = net.input("x", 10), net.input("y", dtype="int32")
    logits = Linear(16, 2)(Linear(10, 16, activation="tanh")(x))
    net.outputs(loss=lm.layers.SoftmaxCrossEntropy()(logits, y), logits=logits)
    opt = lm.optim.Adam(net, lr=0.02)
    first = net.train_step({"x": X, "y": Y}, opt)
    for _ in range(59):
        last = net.train_step({"x": X, "y": Y}, opt)
    assert last < first / 2
    assert (net.run({"x": X})["logits"].argmax(1) == Y).mean() > 0.9


def test_backward_from_given_output_gradients():
    """forward(grad_outputs=[...]) + backward(grad_outputs={...}) is torch's y.backward(g)."""
    rng = np.random.default_rng(9)
    net = lm.Network(dtype="float64")
    x = net.input("x", 5)
    x.requires_grad = True
    fc = Linear(5, 3)
    net.outputs(y=fc(x))
    net.astype("float64")
    X, G = rand(rng, 4, 5), rand(rng, 4, 3)
    net.forward({"x": X}, grad_outputs=["y"])
    assert net.backward(grad_outputs={"y": G}) is None
    np.testing.assert_allclose(net.grad("x"), G @ fc.weight.value, rtol=1e-13)
    np.testing.assert_allclose(fc.weight.grad, G.T @ X, rtol=1e-13)
    np.testing.assert_allclose(fc.bias.grad, G.sum(0), rtol=1e-13)
    with pytest.raises(lm.InputError, match=r"gradient of output 'y' must be a float64 array of shape \(4, 3\)"):
        net.backward(grad_outputs={"y": G[:2]})
    with pytest.raises(lm.GraphError, match="the forward declared grad_outputs"):
        net.backward()


def test_a_reshape_of_one_output_of_a_multi_output_layer_is_a_view():
    """The LSTM's sequence output read by a reshape alone: the reshape does not run, its output
    is the LSTM's buffer (the LSTM's final states, its other outputs, stay its own), and the
    answers are the training forward's, exactly; a tanh after the LSTM stays a node (an
    activation fuses only into a layer of one output)."""
    net = lm.Network()
    h, last, cell = lm.layers.LSTM(4, 6, name="lstm")(net.input("x", 4, sequence=True))
    flat = lm.layers.Reshape((2, 3), name="flat")(h)
    net.outputs(y=Activation("tanh", name="squash")(lm.layers.Reshape((6,), name="back")(flat)), last=last)
    net.outputs(z=Activation("tanh", name="direct")(cell))
    plan = net.scheduler.plan(False, ("y", "last", "z"))
    assert plan.aliases == {"flat": h.name, "back": "flat"} and plan.fused == {}
    rng = np.random.default_rng(9)
    X = lm.Sequences.from_list([rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 2, 3)])
    got, want = net.run({"x": X}), net.forward({"x": X}, training=True)
    for name in ("y", "last", "z"):
        np.testing.assert_array_equal(np.asarray(getattr(got[name], "values", got[name])),
                                      np.asarray(getattr(want[name], "values", want[name])), err_msg=name)
    with net.scheduler.borrowed(plan) as b:
        assert b.values["flat"].__array_interface__["data"][0] == b.values[h.name].__array_interface__["data"][0]
        assert {"flat", "back"}.isdisjoint(n.name for n, _ in b.contexts)


def pooled_net(dtype, conv, pool, activation=True, extra_reader=False, size=(8, 5, 6, 7)):
    net = lm.Network()
    x = net.input("x", size[:1] + size[1:][-conv.nd:])
    c = conv(x)
    a = Activation("relu", name="act")(c) if activation else c
    outputs = {"y": pool(a)}
    if extra_reader:
        outputs["z"] = Activation("tanh")(a)
    net.outputs(**outputs)
    return net.astype(dtype)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", ["winograd 2d", "winograd 3d", "winograd 3d, no activation", "padded pool",
                                  "direct", "direct 3d", "direct 3d, pool 1x2x2", "direct wide, no activation"])
def test_inference_runs_a_max_pool_inside_the_convolution_before_it(dtype, case, request):
    """conv (-> ReLU) -> max pool runs as one node: where Winograd's 2x2(x2) tiles are the pool's
    windows its kernel stores each tile's maximum (odd sizes: the cut tiles store nothing), and
    the direct kernel each window's (windows of 1 or 2 x 2 x 2; 45 widths: whole register tiles,
    the last moved back, and a cut window), else the convolution goes to a workspace and is pooled
    from there; the answers are the training forward's (nothing fused), exactly."""
    L = lm.layers
    lm.manual_seed(21)
    conv, pool = {
        "winograd 2d": (L.Conv2d(8, 8, 3, padding=1, name="conv"), L.MaxPool2d(2, name="pool")),
        "winograd 3d": (L.Conv3d(8, 8, 3, padding=1, name="conv"), L.MaxPool3d(2, name="pool")),
        "winograd 3d, no activation": (L.Conv3d(8, 8, 3, padding=1, name="conv"), L.MaxPool3d(2, name="pool")),
        "padded pool": (L.Conv2d(8, 8, 3, padding=1, name="conv"), L.MaxPool2d(3, stride=2, padding=1, name="pool")),
        "direct": (L.Conv2d(8, 3, 3, padding=1, name="conv"), L.MaxPool2d(2, name="pool")),
        "direct 3d": (L.Conv3d(8, 3, 3, padding=1, name="conv"), L.MaxPool3d(2, name="pool")),
        "direct 3d, pool 1x2x2": (L.Conv3d(8, 5, 3, padding=1, name="conv"), L.MaxPool3d((1, 2, 2), name="pool")),
        "direct wide, no activation": (L.Conv2d(1, 5, 3, padding=1, name="conv"), L.MaxPool2d(2, name="pool")),
    }[case]
    size = (1, 1, 9, 45) if "wide" in case else (8, 5, 6, 7)
    if case.startswith("winograd"):  # (the rule runs a batch this small as columns)
        lm.set_conv_algorithm("winograd")
        request.addfinalizer(lambda: lm.set_conv_algorithm("rule"))
    net = pooled_net(dtype, conv, pool, activation="no activation" not in case, size=size)
    plan = net.scheduler.plan(False, ("y",))
    assert plan.pooled == {"conv": (pool._window(), "pool")} and plan.absorbed == {"pool"}
    X = np.random.default_rng(22).standard_normal((3,) + net.values["x"].spec.shape).astype(dtype)
    want = net.forward({"x": X}, training=True)["y"]
    got = net.run({"x": X})["y"]
    assert got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    with net.scheduler.borrowed(plan) as b:  # the Winograd kernel pools as it stores: no full output
        assert (("conv", "unpooled") in b._workspaces) == (case == "padded pool")
        assert [n.name for n, _ in b.contexts] == ["conv"]


def test_a_max_pool_stays_a_node_where_its_input_is_wanted_elsewhere():
    L = lm.layers
    net = pooled_net("float32", L.Conv2d(8, 8, 3, padding=1, name="conv"), L.MaxPool2d(2, name="pool"),
                     extra_reader=True)
    assert net.scheduler.plan(False, ("y", "z")).pooled == {}
    net = pooled_net("float32", L.Conv2d(8, 8, 3, padding=1, name="conv"), L.MaxPool2d(2, name="pool"))
    net.outputs(conv_out=net.nodes[0].output)
    assert net.scheduler.plan(False, ("y", "conv_out")).pooled == {}
    assert net.scheduler.plan(False, ("y",)).pooled != {}
    assert net.scheduler.plan(True, ("y",)).pooled == {}
    X = np.random.default_rng(23).standard_normal((2, 8, 6, 7)).astype(np.float32)
    got = net.run({"x": X}, outputs=["y", "conv_out"])
    np.testing.assert_array_equal(got["y"], net.forward({"x": X}, training=True)["y"])
