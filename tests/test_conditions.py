"""Compare and Where (lamina.layers.select): numpy's answers on every backend, NaN and zeros
included; float64 gradient checks; and ONNX's comparisons, logic and Where as PyTorch's two
exporters write them (torch.where, masked_fill, hardshrink, softshrink, logical operators),
matching ONNX Runtime and PyTorch, training like PyTorch, and exported back."""
import io
import warnings

import numpy as np
import pytest

import lamina as lm
from lamina.backends import get_backend
from lamina.backends.reference import ReferenceBackend
from lamina.layers import Compare, Where
from lamina.testing import add_probe_cost, check_gradients, core_only, probe_feed
from conftest import _OPENCL

# the networks' backends: the CPU's, the reference stripped to the core kernels, and the OpenCL
# device where there is one
PLACES = {"cpu": lambda: get_backend("cpu"), "reference-core": lambda: core_only(ReferenceBackend)()}
if _OPENCL is not None:
    PLACES["opencl"] = lambda: _OPENCL


@pytest.fixture(params=sorted(PLACES))
def place(request):
    return PLACES[request.param]()

NUMPY_TESTS = {"greater": np.greater, "less": np.less, "greater_equal": np.greater_equal,
               "less_equal": np.less_equal, "equal": np.equal}


def _values(rng, shape):
    x = rng.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1)
    flat[:3] = (0.0, -0.0, np.nan)
    flat[3:5] = (np.inf, -np.inf)
    return x


@pytest.mark.parametrize("op", sorted(NUMPY_TESTS))
def test_compare_against_numpy_on_every_backend(op, place):
    net = lm.Network()
    x = net.input("x", (3, 4))
    net.outputs(y=Compare(op)(x)).to(place)
    a = _values(np.random.default_rng(1), (5, 3, 4))
    with np.errstate(invalid="ignore"):
        want = NUMPY_TESTS[op](a, 0).astype(np.float32)
    np.testing.assert_array_equal(net.run({"x": a})["y"], want)


def test_where_against_numpy_on_every_backend(place):
    net = lm.Network()
    c, a, b = (net.input(k, (2, 3)) for k in ("c", "a", "b"))
    fixed_b = Where((2, 3), fixed=("b",))
    fixed_b.params["b"].assign(np.arange(6.0).reshape(2, 3))
    fixed_cond = Where((2, 3), fixed=("cond",))
    fixed_cond.params["cond"].assign(np.array([[1, 0, 1], [0, 0, 1]], np.float32))
    m = Compare("greater")(c)
    net.outputs(y=Where((2, 3))(m, a, b), yb=fixed_b(m, a), yc=fixed_cond(a, b)).to(place)
    rng = np.random.default_rng(2)
    feeds = {"c": _values(rng, (4, 2, 3)), "a": _values(rng, (4, 2, 3)), "b": rng.standard_normal((4, 2, 3)).astype(np.float32)}
    out = net.run(feeds)
    taken = np.nan_to_num(feeds["c"], nan=-1) > 0
    np.testing.assert_array_equal(out["y"], np.where(taken, feeds["a"], feeds["b"]))
    np.testing.assert_array_equal(out["yb"], np.where(taken, feeds["a"], np.arange(6.0).reshape(2, 3)))
    np.testing.assert_array_equal(out["yc"], np.where(np.array([[1, 0, 1], [0, 0, 1]], bool), feeds["a"], feeds["b"]))


def test_select_kernel_checks_sizes(place):
    be = place
    out = be.empty((2, 3), np.float32)
    cond = be.from_host(np.ones((2, 3), np.float32))
    with pytest.raises(ValueError, match=r"select: b must be float32 of out's size 6 or one row's \(3\), found float32 of size 2"):
        be.select(cond, be.from_host(np.ones(3, np.float32)), be.from_host(np.ones(2, np.float32)), out)
    with pytest.raises(ValueError, match="select: cond must have out's shape"):
        be.select(be.from_host(np.ones(6, np.float32)), cond, cond, out)


@pytest.mark.parametrize("fixed", [(), ("a",), ("b",), ("cond",)])
def test_where_gradients(fixed):
    """Float64: the gradient reaches the branch each element took; the condition and a mask's
    input get none (central differences agree: the mask is constant around every input, which
    lies away from 0)."""
    net = lm.Network()
    c, a, b = (net.input(k, (3, 2)) for k in ("c", "a", "b"))
    layer = Where((3, 2), fixed=fixed)
    rng = np.random.default_rng(3)
    for k in fixed:
        layer.params[k].assign(rng.integers(0, 2, (3, 2)) if k == "cond" else rng.standard_normal((3, 2)))
    operands = {"cond": Compare("less")(c), "a": a, "b": b}
    y = layer(*[operands[k] for k in Where.OPERANDS if k not in fixed])
    probe = add_probe_cost(net, y)
    net.astype("float64")
    feeds = {k: rng.choice([-1, 1], (6, 3, 2)) * rng.uniform(0.5, 2, (6, 3, 2)) for k in ("c", "a", "b")}
    feeds[probe] = probe_feed(net, probe, 6)
    check_gradients(net, feeds)


def test_where_layers_round_trip_through_model_files(tmp_path):
    net = lm.Network()
    x = net.input("x", (4,))
    layer = Where((4,), fixed=("a",))
    layer.params["a"].assign(np.array([1.0, 2.0, 3.0, 4.0]))
    net.outputs(y=layer(Compare("greater_equal")(x), x))
    lm.save(net, tmp_path / "m.lamina")
    back = lm.load(tmp_path / "m.lamina")
    a = np.array([[-1, 2, 0, -3]], np.float32)
    np.testing.assert_array_equal(back.run({"x": a})["y"], [[-1, 2, 3, -3]])  # x >= 0: the fixed a
    assert back.layer(layer.name).params["a"].frozen


def test_bad_where_and_compare_settings():
    with pytest.raises(ValueError, match="op must be one of"):
        Compare("greater_than")
    with pytest.raises(ValueError, match="fixed must name at most two of cond, a, b"):
        Where((2,), fixed=("cond", "a", "b"))
    net = lm.Network()
    x, y = net.input("x", (2,)), net.input("y", (3,))
    with pytest.raises(ValueError, match=r"a must be \[2\] per sample"):
        Where((2,))(x, y, x)


torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn = torch.nn


class Conditional(nn.Module):
    """torch.where with a comparison of two values and with a constant, masked_fill, logical and,
    or and not of comparisons, hardshrink and softshrink."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)

    def forward(self, x, y):
        h = self.fc(x)
        picked = torch.where(h > y, h, 0.5 * y)
        filled = h.masked_fill(h < -0.2, 0.0)
        logic = torch.where((h > 0) & ~(y > 1) | (y < -1), y, h)
        return torch.cat([picked, filled, logic, nn.functional.hardshrink(h, 0.3), nn.functional.softshrink(y, 0.4)],
                         dim=1)


def export(model, args, dynamo):
    f = io.BytesIO()
    kw = {} if dynamo else {"dynamic_axes": {"x": {0: "n"}, "y": {0: "n"}}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, args, f, dynamo=dynamo, input_names=["x", "y"], **kw)
    return f.getvalue()


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_pytorch_conditions_run_train_and_export(dynamo, tmp_path):
    torch.manual_seed(31)
    model = Conditional().eval()
    rng = np.random.default_rng(31)
    x, y = (rng.standard_normal((3, 6)).astype(np.float32) for _ in range(2))
    blob = export(model, (torch.from_numpy(x), torch.from_numpy(y)), dynamo)
    net = lm.onnx.load(blob)
    assert {"compare", "where"} <= {layer.kind for layer in net.layers}
    (out_name,) = net.output_values
    ours = net.run({"x": x, "y": y})[out_name]
    theirs = ort.InferenceSession(blob, providers=["CPUExecutionProvider"]).run(None, {"x": x, "y": y})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        np.testing.assert_allclose(ours, model(torch.from_numpy(x), torch.from_numpy(y)).numpy(), rtol=1e-5, atol=1e-6)
    # the gradients of a loss reach the weights through the branches taken, as in PyTorch
    target = rng.standard_normal(ours.shape).astype(np.float32)
    out = net.values[net.output_values[out_name]]
    net.outputs(loss=lm.layers.SquareError()(out, net.input("target", out.spec.shape)))
    net.forward({"x": x, "y": y, "target": target}, outputs=["loss"])
    net.backward()
    xt, yt = torch.from_numpy(x), torch.from_numpy(y)
    loss = ((model(xt, yt) - torch.from_numpy(target)) ** 2).sum() / len(x)  # (lamina's: summed, mean over rows)
    loss.backward()
    for p, q in zip(net.parameters(), [model.fc.weight, model.fc.bias]):
        np.testing.assert_allclose(p.grad, q.grad.numpy(), rtol=1e-4, atol=1e-6)
    # and back to ONNX: ONNX Runtime runs lamina's export to lamina's numbers
    del net.output_values["loss"]
    lm.onnx.save(net, tmp_path / "again.onnx")
    again = ort.InferenceSession(str(tmp_path / "again.onnx"), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(again.run(None, {"x": x, "y": y})[0], ours, rtol=1e-6, atol=1e-6)


def test_where_of_an_infinite_constant_is_refused():
    """masked_fill(-inf): lamina holds a fixed branch as a parameter, which is finite."""
    class InfiniteFill(nn.Module):
        def forward(self, x):
            return x.masked_fill(x < 0, float("-inf")).exp()

    with pytest.raises(lm.onnx.UnsupportedModelError, match="holds NaN or infinity"):
        lm.onnx.load(export_one(InfiniteFill(), False))


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_a_float_value_cast_to_bool_is_a_mask(dynamo):
    class ValueCondition(nn.Module):
        def forward(self, x):
            return torch.where(torch.relu(x).bool(), x, -x)

    model = ValueCondition()
    blob = export_one(model, dynamo)
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    ours = lm.onnx.load(blob).run({"x": x})
    np.testing.assert_array_equal(next(iter(ours.values())), model(torch.from_numpy(x)).numpy())


def export_one(model, dynamo):
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.randn(2, 4),), f, dynamo=dynamo, input_names=["x"])
    return f.getvalue()
