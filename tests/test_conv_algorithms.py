"""The CPU backend's convolution algorithms (lamina.backends.cpu.conv_algorithms): every algorithm that
applies to a layer, forced with lm.set_conv_algorithm, against the direct-loop numpy reference
and in the float64 gradient checks; Winograd's float32 error; the 'measure' mode; the compiled
kernels' own refusals of sizes that would read or write outside their arrays."""
import itertools

import numpy as np
import pytest

import lamina as lm
from lamina.backends.cpu import _kernels
from lamina.backends.cpu import compiled as cpu_compiled
from lamina.backends.cpu import conv_algorithms as cpu_conv
from lamina.backends.cpu import pointwise as cpu_pointwise
from lamina.layers import Conv2d, Conv3d, ConvTranspose2d, ConvTranspose3d
from lamina.testing import add_probe_cost, check_gradients, probe_feed
from lamina.threads import SettingError
from test_conv import CASES, conv_net, layer_reference

# Winograd's shapes (kernel 3, stride 1, one group): volumes and images, padding 0..2 (the input
# gradient's is 2 - padding), odd sizes so the last tile along every axis is partial, channel
# counts that are not whole vectors, a kernel of depth 1
WINOGRAD = [
    (Conv3d, 3, 5, (5, 6, 7), dict(kernel_size=3, padding=1)),
    (Conv3d, 2, 3, (4, 5, 3), dict(kernel_size=3, padding=(0, 2, 1))),
    (Conv3d, 9, 2, (3, 4, 5), dict(kernel_size=3, padding=2, bias=False)),
    (Conv3d, 2, 4, (3, 5, 6), dict(kernel_size=(1, 3, 3), padding=(0, 1, 1))),
    (Conv2d, 3, 10, (7, 5), dict(kernel_size=3, padding=1)),
    (Conv2d, 1, 3, (4, 9), dict(kernel_size=3)),
    # channels and widths past whole blocks of vector lanes (the channels-last copy transposes
    # lanes x lanes blocks, the rest one value at a time)
    (Conv2d, 11, 3, (3, 13), dict(kernel_size=3, padding=1)),
]
# transposed with kernel = stride (each output written once, depth to space): widths with whole
# vectors and a remainder, a stride of 1 along one axis, groups
NO_OVERLAP = [
    (ConvTranspose3d, 3, 5, (3, 2, 11), dict(kernel_size=2, stride=2)),
    (ConvTranspose3d, 2, 4, (2, 3, 4), dict(kernel_size=(1, 2, 3), stride=(1, 2, 3), bias=False)),
    (ConvTranspose2d, 4, 6, (5, 9), dict(kernel_size=2, stride=2, groups=2)),
]
# rows wider than one register tile of the direct kernel (16 floats) and not a multiple of it: the
# last tile of a row moves back to end where the row ends; groups, and a row of exactly one tile
WIDE = [
    (Conv2d, 3, 5, (3, 21), dict(kernel_size=3, padding=1)),
    (Conv3d, 4, 6, (2, 3, 37), dict(kernel_size=(1, 2, 3), groups=2)),
    (Conv2d, 2, 3, (3, 18), dict(kernel_size=3)),
]
# pointwise (kernel 1, stride 1, no padding): the column algorithm's GEMMs read the input itself
POINTWISE = [
    (Conv3d, 4, 6, (3, 4, 5), dict(kernel_size=1, groups=2)),
    (Conv2d, 3, 1, (5, 7), dict(kernel_size=1, bias=False)),
    # one group: output channels past whole tiles of 6 rows, positions past whole panels of 16
    # floats (the last panel ends where the rows end), depth; by positions: fewer positions than
    # the panels take (49, 15), and an input deeper than they take (output channels past one
    # panel of 16, positions past whole tiles of 6)
    (Conv2d, 13, 11, (7, 7), dict(kernel_size=1)),
    (Conv2d, 5, 7, (3, 5), dict(kernel_size=1)),
    (Conv3d, 3, 20, (2, 3, 9), dict(kernel_size=1, bias=False)),
    (Conv2d, 260, 20, (9, 9), dict(kernel_size=1)),
]
# one group per input channel (depthwise): strides, dilation, asymmetric padding, a channel
# multiplier, a volume, windows past the input's edges on every side
DEPTHWISE = [
    (Conv2d, 6, 6, (9, 10), dict(kernel_size=3, padding=1, groups=6)),
    (Conv2d, 4, 4, (11, 8), dict(kernel_size=3, stride=2, padding=1, groups=4, bias=False)),
    (Conv2d, 3, 6, (7, 9), dict(kernel_size=(3, 5), padding=(2, 1), dilation=(2, 1), groups=3)),
    (Conv2d, 5, 5, (6, 7), dict(kernel_size=3, stride=(1, 3), padding=((1, 0), (2, 1)), groups=5)),
    (Conv3d, 4, 8, (4, 5, 6), dict(kernel_size=3, stride=(1, 2, 2), padding=1, groups=4)),
    (Conv2d, 7, 7, (7, 7), dict(kernel_size=3, padding=1, groups=7)),  # MobileNet's last planes
    (Conv2d, 5, 5, (14, 14), dict(kernel_size=5, stride=2, padding=2, groups=5)),  # EfficientNet's
    (Conv2d, 3, 3, (40, 37), dict(kernel_size=3, stride=(2, 1), padding=(0, 1), groups=3, bias=False)),
    (Conv2d, 4, 4, (9, 11), dict(kernel_size=3, padding=2, dilation=(2, 3), groups=4)),  # 3 x 3 by channels, dilated
]
ALL = CASES + WINOGRAD + NO_OVERLAP + WIDE + POINTWISE + DEPTHWISE


@pytest.fixture
def algorithm():
    """Restores the rule after a test that forces an algorithm."""
    yield lm.set_conv_algorithm
    lm.set_conv_algorithm("rule")


def forced_cases(cases):
    """(case, algorithm) for every algorithm that applies to each convolution."""
    return [(case, name) for case in cases for name in cpu_conv.candidates(case[0](case[1], case[2], **case[4]))]


FORCED = forced_cases(ALL)


@pytest.mark.parametrize("case,name", FORCED, ids=[f"{c[0].__name__}-{i}-{n}" for i, (c, n) in enumerate(FORCED)])
def test_every_algorithm_matches_direct_loops(case, name, algorithm):
    algorithm(name)
    net, x, layer = conv_net(case)
    net.outputs(y=layer(x))
    assert layer.algorithms(net.backend)["forward"] == name
    X = np.random.default_rng(2).standard_normal((3,) + x.spec.shape)
    ref = layer_reference(layer, X)
    for dtype, tol in (("float64", 1e-12), ("float32", 2e-5)):
        net.astype(dtype)
        np.testing.assert_allclose(net.run({"x": X.astype(dtype)})["y"], ref, rtol=tol, atol=tol, err_msg=dtype)


FUSED = [(case, name, kind) for case, name in forced_cases(WINOGRAD + WIDE + CASES[:2] + NO_OVERLAP + DEPTHWISE
                                                            + POINTWISE[2:])
         for kind in ("relu", "tanh")] + [(case, name, "bounded_relu") for case, name in forced_cases(DEPTHWISE + POINTWISE[2:])
                                          if name in ("depthwise", "pointwise")]


@pytest.mark.parametrize("case,name,kind", FUSED,
                         ids=[f"{c[0].__name__}-{i}-{n}-{k}" for i, (c, n, k) in enumerate(FUSED)])
def test_a_following_activation_runs_inside_every_algorithm(case, name, kind, algorithm):
    """Inference runs conv -> Activation as one node (the kernels that can add the bias and apply
    a ReLU (the depthwise and pointwise ones a ReLU6 too) as they store do so; the rest take the
    passes after):
    the values equal the unfused run's (a training forward) bit for bit, and the direct-loop
    reference."""
    algorithm(name)
    net, x, layer = conv_net(case)
    slope = 1.0 if kind == "bounded_relu" else 0.01  # (a cap most outputs pass)
    net.outputs(y=lm.layers.Activation(kind, slope=slope)(layer(x)))
    X = np.random.default_rng(3).standard_normal((3,) + x.spec.shape)
    ref = layer_reference(layer, X)
    ref = {"relu": lambda: np.maximum(ref, 0), "tanh": lambda: np.tanh(ref),
           "bounded_relu": lambda: np.clip(ref, 0, slope)}[kind]()
    for dtype, tol in (("float64", 1e-12), ("float32", 2e-5)):
        net.astype(dtype)
        feeds = {"x": X.astype(dtype)}
        fused = net.run(feeds)["y"]
        assert net.scheduler.plan(False, ("y",)).fused == {layer.name: (kind, slope)}
        np.testing.assert_array_equal(fused, net.forward(feeds, training=True)["y"], err_msg=dtype)
        np.testing.assert_allclose(fused, ref, rtol=tol, atol=tol, err_msg=dtype)


def test_forward_kernels_check_their_bias():
    f = np.float32
    xp, y = np.zeros((2, 3, 4, 20), f), np.zeros((4, 1, 2, 2), f)
    packed = np.zeros(1000, f)
    with pytest.raises(ValueError, match=r"bias must hold one value per output channel \(4\), found 3"):
        _kernels.direct_conv_padded(xp, packed, y, 1, 3, 3, 3, 1, 1, 1, 1, 1, bias=np.zeros(3, f))
    with pytest.raises(ValueError, match="a bias or a ReLU applies when the output is overwritten"):
        _kernels.direct_conv_padded(xp, packed, y, 1, 3, 3, 3, 1, 1, 1, 1, 1, accumulate=True, relu=True)
    x = np.zeros((1, 2, 3, 4, 5), f)
    sizes = _kernels.winograd_workspace(2, 4, 3, 4, 5, 1, 1, 1, True, 6, True)
    buffers = [[np.zeros(n, f)] for n in sizes[:3]] + [np.zeros(sizes[3], f)]
    with pytest.raises(ValueError, match=r"winograd_conv: bias must hold one value per output channel \(4\)"):
        _kernels.winograd_conv(x, buffers[3], np.zeros((1, 4, 3, 4, 5), f), *buffers[:3], 1, 1, 1, True, 6,
                               bias=np.zeros(5, f))
    with pytest.raises(ValueError, match="winograd_conv: a bias or a ReLU applies"):
        _kernels.winograd_conv(x, buffers[3], np.zeros((1, 4, 3, 4, 5), f), *buffers[:3], 1, 1, 1, True, 6,
                               True, np.zeros(4, f))


GRADIENT_CASES = [(c, n) for c, n in forced_cases(WINOGRAD + CASES[:6] + NO_OVERLAP + POINTWISE)
                  if n in ("winograd", "direct, width phases", "depth to space", "sub-pixel")
                  or (c in POINTWISE and n == "columns")]


@pytest.mark.parametrize("case,name", GRADIENT_CASES,
                         ids=[f"{c[0].__name__}-{i}-{n}" for i, (c, n) in enumerate(GRADIENT_CASES)])
def test_gradients_with_each_algorithm(case, name, algorithm):
    """Forcing Winograd also runs the input gradient by Winograd (dy with the flipped kernel)."""
    algorithm(name)
    net, x, layer = conv_net(case)
    probe = add_probe_cost(net, layer(x))
    net.astype("float64")
    if name == "winograd":
        assert layer.algorithms(net.backend)["input grad"] == "winograd"
    feeds = {"x": np.random.default_rng(1).standard_normal((2,) + x.spec.shape), probe: probe_feed(net, probe, 2)}
    check_gradients(net, feeds)


# the direct kernel's weight gradient on rows of dy wider than 8 (vectors of 16 widths in the AVX-512
# build, 8 elsewhere): a row of one whole vector, rows past whole vectors (21, 37), groups, a
# width dilation, depth and height strides, a kernel narrower than 3, more output channels than one
# tile of sums (8 in the AVX-512 build, 3 elsewhere) and not a multiple of it; and rows of 8 or less
DIRECT_WEIGHT_GRAD = [
    (Conv2d, 3, 11, (5, 16), dict(kernel_size=3, padding=1)),
    (Conv2d, 2, 9, (4, 21), dict(kernel_size=(3, 2), dilation=(1, 2), padding=(1, 1))),
    (Conv3d, 4, 6, (3, 5, 37), dict(kernel_size=(1, 2, 3), stride=(2, 2, 1), groups=2, padding=1)),
    (Conv3d, 2, 17, (4, 4, 7), dict(kernel_size=3, padding=1, bias=False)),
]


@pytest.mark.parametrize("case", DIRECT_WEIGHT_GRAD, ids=[f"{c[0].__name__}-{c[3]}" for c in DIRECT_WEIGHT_GRAD])
def test_direct_weight_gradient_in_float32_is_within_its_rounding(case, monkeypatch):
    """dW in float32 against the float64 run on the same values, within the rounding of sums of n
    products in float32 (|error| <= n·u/(1 - n·u) · sum of |dy|·|x|, n the outputs a weight
    sums over), on the vectors the kernel takes for the row width."""
    net, x, layer = conv_net(case)
    y = layer(x)
    net.outputs(y=y)  # (no input gradient: the strided case's weight gradient runs direct without one)
    ran = []
    monkeypatch.setattr(cpu_conv.direct, "backward", lambda *args, backward=cpu_conv.direct.backward:
                        ran.append(1) or backward(*args))
    rng = np.random.default_rng(5)
    X = rng.standard_normal((3,) + x.spec.shape).astype(np.float32)
    G = rng.standard_normal((3,) + y.spec.shape).astype(np.float32)
    lanes = _kernels.direct_conv_dw_lanes(True, y.spec.shape[-1])
    assert lanes == (8 if y.spec.shape[-1] <= 8 or cpu_compiled.PATH not in ("avx512", "amx") else 16)

    def weight_grad(dtype, xs, gs):
        net.astype(dtype)
        net.zero_grad()
        net.forward({"x": xs.astype(dtype)}, grad_outputs=["y"])
        net.backward(grad_outputs={"y": gs.astype(dtype)})
        return layer.weight.dense_grad(net.backend).astype(np.float64)
    got, want = weight_grad("float32", X, G), weight_grad("float64", X, G)
    assert len(ran) == 2
    magnitude = weight_grad("float64", np.abs(X), np.abs(G))  # sum of |dy|·|x| per weight (zero padding: 0)
    n = 3 * int(np.prod(y.spec.shape[1:]))
    u = np.finfo(np.float32).eps / 2
    assert np.abs(want).max() > 1
    assert np.all(np.abs(got - want) <= n * u / (1 - n * u) * magnitude)


def test_winograd_input_gradient_adds_to_another_consumers(algorithm):
    """Two convolutions read one input: the second's Winograd input gradient adds (beta 1)."""
    algorithm("winograd")
    net = lm.Network()
    x = net.input("x", (3, 5, 4, 6))
    probes = [add_probe_cost(net, Conv3d(3, 4, 3, padding=p)(x)) for p in (1, 2)]
    net.astype("float64")
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3, 5, 4, 6))}
    for seed, name in enumerate(probes, 1):
        feeds[name] = probe_feed(net, name, 2, seed=seed)
    check_gradients(net, feeds)


def windowed_conv(x, w, padding):
    """A stride-1, one-group convolution in float64 by sliding windows (fast for large cases)."""
    xp = np.pad(x, [(0, 0), (0, 0)] + [(p, p) for p in padding])
    windows = np.lib.stride_tricks.sliding_window_view(xp, w.shape[2:], axis=(2, 3, 4))
    return np.einsum("ncdhwijk,ocijk->nodhw", windows, w, optimize=True)


def test_winograd_float32_error_is_bounded(algorithm):
    """F(2x2x2, 3x3x3) in float32 against float64, in units of the sum of |w·x| over each output's
    terms (the size a float32 dot product's rounding scales with): measured 1.0e-7 for Winograd and
    2.3e-7 for the direct kernel on 32 -> 32 channels of uniform values; bounded here by 4e-7."""
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", (32, 10, 10, 10))
    layer = Conv3d(32, 32, 3, padding=1, bias=False)
    net.outputs(y=layer(x))
    X = np.random.default_rng(0).uniform(-1, 1, (2, 32, 10, 10, 10))
    w = layer.weight.value.astype(np.float64)
    ref = windowed_conv(X, w, (1, 1, 1))
    scale = windowed_conv(np.abs(X), np.abs(w), (1, 1, 1))
    errors = {}
    for name in ("winograd", "direct"):
        algorithm(name)
        errors[name] = float(np.max(np.abs(net.run({"x": X.astype(np.float32)})["y"] - ref) / scale))
    assert errors["winograd"] < 4e-7, errors
    assert errors["direct"] < 4e-7, errors


def test_the_rule_and_measure_mode(algorithm):
    assert lm.get_conv_algorithm() == "rule"
    wide, narrow = Conv3d(16, 16, 3, padding=1), Conv2d(1, 32, 3, padding=1)
    be = lm.CPUBackend()
    assert wide.algorithms(be) == {"forward": "winograd", "input grad": "winograd", "weight grad": "direct"}
    assert narrow.algorithms(be)["forward"] == "direct"  # one input channel: Winograd pads it to eight
    assert Conv3d(4, 4, 3, stride=2).algorithms(be)["forward"] == "columns"
    # pointwise: panel tiles on the input forward, GEMMs on it backward (with groups, GEMMs both
    # ways); by panels of positions, or by tiles of positions where the sample has fewer
    # positions than the panels take or its input is deeper than they take
    pointwise = {"forward": "pointwise", "input grad": "columns", "weight grad": "columns"}
    assert Conv3d(16, 8, 1).algorithms(be, (4, 4, 4)) == pointwise
    assert set(Conv3d(16, 8, 1, groups=2).algorithms(be, (4, 4, 4)).values()) == {"columns"}
    deep = Conv2d(cpu_pointwise.PANELS_MAX_DEPTH + 1, 8, 1)
    assert deep.algorithms(be, (8, 8)) == pointwise and Conv2d(16, 8, 1).algorithms(be, (7, 7)) == pointwise
    kernel = cpu_pointwise.kernel
    assert kernel(deep.in_channels, 64, 4) == kernel(16, 49, 4) == "positions"
    assert kernel(cpu_pointwise.PANELS_MAX_DEPTH, 64, 4) == "panels"
    assert kernel(2304, 784, 4) is None  # (x past the L2 cache: OpenBLAS's GEMM, on columns)
    # a one-group convolution on columns: each block's product on the pointwise kernels
    assert Conv2d(3, 32, 3, stride=2, padding=1).algorithms(be, (32, 32))["forward"] == "columns"
    up = dict(kernel_size=3, stride=2, padding=1, output_padding=1)
    assert ConvTranspose3d(8, 8, groups=4, **up).algorithms(be)["forward"] == "sub-pixel"
    assert ConvTranspose3d(8, 8, **up).algorithms(be)["forward"] == "columns"
    assert ConvTranspose3d(8, 8, 2, stride=2, groups=4).algorithms(be)["forward"] == "depth to space"
    assert Conv2d(32, 32, 3, stride=2, padding=1, groups=32).algorithms(be) == {
        "forward": "depthwise", "input grad": "depthwise", "weight grad": "depthwise"}
    net = lm.Network()
    x = net.input("x", (16, 6, 6, 6))
    net.outputs(y=wide(x))
    X = np.random.default_rng(0).standard_normal((2, 16, 6, 6, 6)).astype(np.float32)
    want = net.run({"x": X})["y"]
    algorithm("measure")
    assert wide.algorithms(be)["forward"] == "measured"
    np.testing.assert_allclose(net.run({"x": X})["y"], want, rtol=1e-5, atol=1e-5)
    assert list(cpu_conv._measured.values())[0] in cpu_conv.candidates(wide)
    with pytest.raises(SettingError, match="expected 'rule', 'measure' or one of depthwise, pointwise, winograd"):
        lm.set_conv_algorithm("fft")


def test_compiled_convolution_kernels_refuse_bad_sizes():
    f = np.float32
    x = np.zeros((2, 3, 4, 5), f)
    with pytest.raises(ValueError, match=r"padded_copy: the padded scratch must be \[2, >=4, >=5, >=6\]"):
        _kernels.padded_copy(x, np.zeros((2, 3, 4, 5), f), 1, 1, 1)
    with pytest.raises(ValueError, match=r"padded_copy: .* \[4, >=3, >=4, >=3\]"):
        _kernels.padded_copy(x, np.zeros((2, 3, 4, 9), f), 0, 0, 0, 2)
    xp = np.zeros((2, 3, 4, 20), f)
    y = np.zeros((4, 1, 2, 2), f)
    _kernels.direct_conv_padded(xp, np.zeros(1000, f), y, 1, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 2)  # the last fit
    with pytest.raises(ValueError, match=r"reads the padded input up to \(2, 3, 20\), outside its \(3, 4, 20\)"):
        _kernels.direct_conv_padded(xp, np.zeros(1000, f), y, 1, 3, 3, 3, 1, 1, 1, 1, 1, 0, 0, 3)
    with pytest.raises(ValueError, match="the packed weights hold 10 values, expected 72"):
        _kernels.direct_conv_padded(xp, np.zeros(10, f), np.zeros((4, 1, 2, 2), f), 1, 1, 3, 3, 1, 1, 1, 1, 1)
    with pytest.raises(ValueError, match="groups must be at least 1"):
        _kernels.direct_conv_dw(x, x, np.zeros(10, f), xp, xp, np.zeros(10, f), 0, 1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1)
    v, w9 = np.zeros((2, 3, 1, 4, 5), f), np.zeros((3, 9), f)  # depthwise: 3 channels, 3 x 3 taps
    for bad, match in ((dict(w=np.zeros((3, 8), f)), r"weights must be \[3, 9\], found \[3, 8\]"),
                       (dict(y=np.zeros((2, 4, 1, 2, 3), f), w=np.zeros((4, 9), f)), "4 output channels for 3"),
                       (dict(y=np.zeros((1, 3, 1, 2, 3), f)), "2 input samples for 1 output"),
                       (dict(stride=0), "strides and dilation must be at least 1")):
        args = dict(w=w9, y=np.zeros((2, 3, 1, 2, 3), f), stride=1) | bad
        with pytest.raises(ValueError, match=match):
            _kernels.depthwise_conv(v, args["w"], args["y"], None, False, 0, np.zeros((1, 1000), f), 1, 3, 3, 1,
                                    args["stride"], 1, 0, 0, 0, 1, 1, 1)
    size = _kernels.depthwise_scratch_size(2, 3, 3, 3, 1, 1, 1, 1)
    _kernels.depthwise_conv(v, w9, np.zeros((2, 3, 1, 2, 3), f), None, False, 0, np.zeros((2, size), f), 1, 3, 3,
                            1, 1, 1, 0, 0, 0, 1, 1, 1)  # the size it asks for
    with pytest.raises(ValueError, match=rf"scratch must be \[threads, {size}\], found \[2, {size - 1}\]"):
        _kernels.depthwise_conv(v, w9, np.zeros((2, 3, 1, 2, 3), f), None, False, 0, np.zeros((2, size - 1), f), 1,
                                3, 3, 1, 1, 1, 0, 0, 0, 1, 1, 1)
    with pytest.raises(ValueError, match=r"sums must be \[3, 9\]"):
        _kernels.depthwise_conv_weight_grad(v, np.zeros((2, 3, 1, 2, 3), f), w9, np.zeros((3, 8)), 0.0, 1, 3, 3, 1,
                                            1, 1, 0, 0, 0, 1, 1, 1)
    sizes = _kernels.winograd_workspace(2, 4, 3, 4, 5, 1, 1, 1, True, 6, True)
    x, y = x[None], np.zeros((1, 4, 3, 4, 5), f)
    buffers = [[np.zeros(n, f)] for n in sizes[:3]] + [np.zeros(sizes[3], f)]
    _kernels.winograd_conv(x, buffers[3], y, *buffers[:3], 1, 1, 1, True, 6)  # the sizes it asks for
    with pytest.raises(ValueError, match=f"packed must hold at least {sizes[3]} values, found {sizes[3] - 1}"):
        _kernels.winograd_conv(x, buffers[3][:-1], y, *buffers[:3], 1, 1, 1, True, 6)
    with pytest.raises(ValueError, match=rf"xcl\[0\] must hold at least {sizes[0]} values, found {sizes[0] - 1}"):
        _kernels.winograd_conv(x, buffers[3], y, [buffers[0][0][:-1]], *buffers[1:3], 1, 1, 1, True, 6)
    col = np.zeros((8, 12), f)
    _kernels.depth_to_space(col, np.zeros((2, 2, 4, 6), f), 1, 2, 2, 0, 4)
    with pytest.raises(ValueError, match=r"depth_to_space: window rows \[0, 5\) of 4 need col \[8, >=15\]"):
        _kernels.depth_to_space(col, np.zeros((2, 2, 4, 6), f), 1, 2, 2, 0, 5)
    with pytest.raises(ValueError, match=r"depth_to_space: strides \(1, 3, 2\) .* divide the volume \(2, 4, 6\)"):
        _kernels.depth_to_space(col, np.zeros((2, 2, 4, 6), f), 1, 3, 2, 0, 4)
    with pytest.raises(ValueError, match=r"gives outputs \(3, 4, 5\), found y \(3, 4, 4\)"):
        _kernels.winograd_conv(x, buffers[3], y[..., :4].copy(), *buffers[:3], 1, 1, 1, True, 6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("strides,rows", [((2, 2, 2), (0, 6)), ((1, 2, 3), (1, 5)), ((2, 1, 2), (2, 6))])
@pytest.mark.parametrize("bias,relu", [(False, False), (True, False), (False, True), (True, True)])
def test_depth_to_space_places_adds_the_bias_and_clips(dtype, strides, rows, bias, relu):
    """Each window row's columns land once in the output (a NaN-filled one: never read), plus
    the channel's bias, through a ReLU: numpy's reshapes and transposes of the same columns. Width
    stride 2 takes the shuffling path (9 positions: a whole vector and a remainder)."""
    sd, sh, sw = strides
    C, oD, oH, oW = 3, 2, 3, 9
    r0, r1 = rows
    rng = np.random.default_rng(sum(strides) + r0)
    col = rng.standard_normal((C * sd * sh * sw, (r1 - r0) * oW)).astype(dtype)
    b = rng.standard_normal(C).astype(dtype) if bias else None
    y = np.full((C, oD * sd, oH * sh, oW * sw), np.nan, dtype)
    _kernels.depth_to_space(col, y, sd, sh, sw, r0, r1, b, relu)
    want = np.full_like(y, np.nan)
    placed = col.reshape(C, sd, sh, sw, r1 - r0, oW)
    for r in range(r0, r1):
        od, oh = divmod(r, oH)
        block = placed[:, :, :, :, r - r0].transpose(0, 1, 2, 4, 3)  # [C, sd, sh, oW, sw]
        want[:, od * sd:(od + 1) * sd, oh * sh:(oh + 1) * sh, :] = block.reshape(C, sd, sh, oW * sw)
    written = ~np.isnan(want)
    if bias:
        want += b[:, None, None, None]
    if relu:
        want = np.where(want < 0, 0, want)
    np.testing.assert_array_equal(y[written], want[written])
    assert np.isnan(y[~written]).all()  # (rows outside [r0, r1) untouched)
    if bias:
        with pytest.raises(ValueError, match=r"depth_to_space: bias must hold one value per output channel \(3\)"):
            _kernels.depth_to_space(col, y, sd, sh, sw, r0, r1, b[:2], relu)


def test_kernels_overwrite_outputs_full_of_nan():
    """Overwriting kernels never read their output: NaN there before changes nothing."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    sizes = _kernels.winograd_workspace(3, 5, 4, 5, 6, 1, 1, 1, True, 6, True)
    packed = rng.standard_normal(sizes[3]).astype(np.float32)
    results = []
    for fill in (0.0, np.nan):
        y = np.full((1, 5, 4, 5, 6), fill, np.float32)
        _kernels.winograd_conv(x[None], packed, y, *([np.full(n, fill, np.float32)] for n in sizes[:3]), 1, 1, 1, True, 6)
        xp = np.full((3, 6, 7, 24), fill, np.float32)
        _kernels.padded_copy(x, xp, 1, 1, 1)
        z = np.full((5, 4, 5, 6), fill, np.float32)
        _kernels.direct_conv_padded(xp, packed[:5 * 8 * 27], z, 1, 3, 3, 3, 1, 1, 1, 1, 1)
        results.append((y, z))
    for a, b in zip(*results):
        assert np.isfinite(b).all()
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("pool_depth, shape", [(1, (2, 1, 7, 37)), (2, (3, 5, 6, 20)), (1, (1, 3, 4, 4))])
def test_the_direct_kernel_pools_as_it_stores(dtype, pool_depth, shape):
    """direct_conv with pool_depth stores only the max pool (pool_depth x 2 x 2, rounded down) of
    what it stores without: equal to the numpy pool of its plain output, to the last bit, over
    NaN-filled outputs; with a bias and a ReLU, and 5 output channels (a partial block of 4);
    widths 37 (whole tiles, the last moved back, a cut window), 20 and 4 (one partial tile); the
    pooled call on a team of 2 threads, each padding into its own row of xp."""
    rng = np.random.default_rng(3)
    cin, cout = shape[0], 5
    x = rng.standard_normal((2,) + shape).astype(dtype)
    packed = rng.standard_normal(2 * cin * 27 * 4).astype(dtype)
    bias = rng.standard_normal(cout).astype(dtype)
    d, h, w = shape[1:]
    xp = [np.zeros((cin, d + 2, h + 2, w + 2 + 16), dtype) for _ in range(2)]
    full = np.empty((2, cout, d, h, w), dtype)
    _kernels.direct_conv(x, packed, full, xp, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, False, bias, True)
    pd, ph, pw = d // pool_depth, h // 2, w // 2
    windows = full[:, :, :pd * pool_depth, :2 * ph, :2 * pw].reshape(2, cout, pd, pool_depth, ph, 2, pw, 2)
    pooled = np.full((2, cout, pd, ph, pw), np.nan, dtype)
    _kernels.direct_conv(x, packed, pooled, xp, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, False, bias, True, threads=2,
                         pool_depth=pool_depth)
    np.testing.assert_array_equal(pooled, windows.max(axis=(3, 5, 7)))
    with pytest.raises(ValueError, match="pool_depth must be 0, 1 or 2, and 0 with accumulate; found 3"):
        _kernels.direct_conv(x, packed, pooled, xp, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, pool_depth=3)
    with pytest.raises(ValueError, match="found 1 with accumulate"):
        _kernels.direct_conv(x, packed, pooled, xp, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, True, pool_depth=1)
    too_tall = np.zeros((2, cout, pd, ph + 1, pw), dtype)  # its windows would read past the padded input
    with pytest.raises(ValueError, match="reads the padded input up to"):
        _kernels.direct_conv(x, packed, too_tall, xp, 1, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1, pool_depth=pool_depth)


@pytest.mark.parametrize("name", ["winograd", "direct", "direct, width phases"])
def test_packed_weights_follow_every_update(name, algorithm):
    """The layouts these algorithms derive from the weight (Parameter.derived) are rebuilt after
    an optimizer step and after assign: the next forward equals the column algorithm's."""
    stride = 2 if name == "direct, width phases" else 1
    net = lm.Network()
    x = net.input("x", (8, 5, 6, 7))
    layer = Conv3d(8, 8, 3, padding=1, stride=(1, 1, stride))
    y = layer(x)
    net.outputs(y=y, cost=lm.layers.SquareError()(y, net.input("t", y.spec.shape)))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((2, 8, 5, 6, 7)).astype(np.float32),
             "t": rng.standard_normal((2,) + y.spec.shape).astype(np.float32)}
    opt = lm.optim.SGD(net.parameters(), lr=0.5)

    def both():
        algorithm(name)
        got = net.run({"x": feeds["x"]}, ["y"])["y"]
        algorithm("columns")
        return got, net.run({"x": feeds["x"]}, ["y"])["y"]
    before = both()[0]
    algorithm(name)
    net.train_step(feeds, opt)
    got, want = both()
    assert np.abs(got - before).max() > 1e-2 * np.abs(before).max()  # the step moved the weights
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())
    layer.weight.assign(rng.standard_normal(layer.weight.shape))
    got, want = both()
    np.testing.assert_allclose(got, want, atol=1e-5 * np.abs(want).max())


def test_batched_kernels_share_the_samples_between_a_team():
    """A compiled batch call runs on a team of threads (team.h), each member taking runs of samples
    into its own scratch: every sample's result is the one-thread result, to the bit, with
    more members than samples too; a team larger than its scratch arrays is refused, and so is a
    scratch array of another type or too small."""
    rng = np.random.default_rng(3)
    f = np.float32
    x = rng.standard_normal((4, 3, 1, 5, 6)).astype(f)
    sizes = _kernels.winograd_workspace(3, 5, 1, 5, 6, 0, 1, 1, False, 6, True)
    packed = rng.standard_normal(sizes[3]).astype(f)
    direct_packed = rng.standard_normal(8 * 3 * 9).astype(f)

    def both(threads, rows=None):
        rows = rows or threads
        scratch = [[np.zeros(n, f) for _ in range(rows)] for n in sizes[:3]]
        wino, direct = np.full((4, 5, 1, 5, 6), np.nan, f), np.full((4, 5, 1, 5, 6), np.nan, f)
        _kernels.winograd_conv(x, packed, wino, *scratch, 0, 1, 1, False, 6, threads=threads)
        _kernels.direct_conv(x, direct_packed, direct, [np.zeros((3, 1, 7, 24), f) for _ in range(rows)], 1, 1, 3, 3,
                             1, 1, 0, 1, 1, 1, 1, 1, threads=threads)
        return wino, direct
    alone = both(1)
    assert not np.isnan(alone[0]).any() and not np.isnan(alone[1]).any()
    for threads in (2, 3, 6):
        for got, want in zip(both(threads), alone):
            np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="xcl must hold a scratch array for each of the 3 threads, found 2"):
        both(3, rows=2)
    y = np.zeros((4, 5, 1, 5, 6), f)
    scratch = [[np.zeros(n, f)] for n in sizes[:3]]
    with pytest.raises(ValueError, match=r"V\[0\] must hold at least \d+ values, found 5"):
        _kernels.winograd_conv(x, packed, y, scratch[0], [np.zeros(5, f)], scratch[2], 0, 1, 1, False, 6)
    with pytest.raises(ValueError, match=r"M\[0\] must be a writable contiguous 1-D array of the data's type"):
        _kernels.winograd_conv(x, packed, y, scratch[0], scratch[1], [np.zeros(sizes[2])], 0, 1, 1, False, 6)
    with pytest.raises(ValueError, match=r"every padded copy must be \(3, 1, 7, 24\) like xp\[0\]"):
        _kernels.direct_conv(x, direct_packed, y, [np.zeros((3, 1, 7, 24), f), np.zeros((3, 1, 7, 25), f)], 1, 1, 3,
                             3, 1, 1, 0, 1, 1, 1, 1, 1, threads=2)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_depthwise_by_channels_equals_the_planes(dtype):
    """The depthwise forward by vectors of channels (small or strided images) gives the plane
    kernel's outputs bit for bit: channel counts that fill no vector or end in a part of one,
    strides, dilation, padding, a bias, ReLU and ReLU6; and refuses what it does not take."""
    rng = np.random.default_rng(7)
    cases = 0
    for C, (H, W), k, s, p, d, bias, (clamp, cap) in itertools.product(
            (1, 5, 8, 19), ((7, 6), (10, 13)), (1, 3, 5), (1, 2), (0, 1, 2), (1, 2), (False, True),
            ((False, 0.0), (True, np.inf), (True, 6.0))):
        oH, oW = ((n + 2 * p - d * (k - 1) - 1) // s + 1 for n in (H, W))
        if min(oH, oW) < 1:
            continue
        x = rng.standard_normal((2, C, 1, H, W)).astype(dtype) * 4
        w = rng.standard_normal((C, k * k)).astype(dtype)
        b = rng.standard_normal(C).astype(dtype) if bias else None
        scratch = np.zeros((2, _kernels.depthwise_scratch_size(oH, oW, k, k, s, s, d, d)), dtype)
        got, want = (np.full((2, C, 1, oH, oW), np.nan, dtype) for _ in range(2))
        for y, by_channels in ((want, False), (got, True)):
            _kernels.depthwise_conv(x, w, y, b, clamp, cap, scratch, 1, k, k, 1, s, s, 0, p, p, 1, d, d, by_channels)
        assert not np.isnan(want).any()
        np.testing.assert_array_equal(got, want, err_msg=f"{C} channels {H}x{W}, kernel {k} stride {s} pad {p} "
                                                         f"dilation {d}")
        cases += 1
    assert cases > 500
    x = np.zeros((1, 2, 1, 5, 5), dtype)
    with pytest.raises(ValueError, match="by channels takes images with one output channel per input channel, "
                                         "found 4 outputs of 2 channels"):
        _kernels.depthwise_conv(x, np.zeros((4, 9), dtype), np.zeros((1, 4, 1, 5, 5), dtype), None, False, 0,
                                np.zeros((1, 1000), dtype), 1, 3, 3, 1, 1, 1, 0, 1, 1, 1, 1, 1, True)


@pytest.mark.parametrize("form", ["plain", "bias relu", "pooled", "accumulated", "volume"])
def test_winograd_shares_a_samples_tiles_when_the_batch_is_smaller_than_the_team(form):
    """With fewer samples than threads the members pad each sample's copy together and then take
    runs of its rows of tiles: every output is the one-thread output, to the bit (odd output sizes,
    so rows of tiles are cut by the output's end; several samples, so the copy is reused)."""
    rng = np.random.default_rng(5)
    f = np.float32
    depth3 = form == "volume"
    shape = (3, 10, 5, 9, 11) if depth3 else (3, 10, 1, 13, 11)
    x = rng.standard_normal(shape).astype(f)
    pd = 1 if depth3 else 0
    sizes = _kernels.winograd_workspace(10, 12, *shape[2:], pd, 1, 1, depth3, 12, True)
    packed = rng.standard_normal(sizes[3]).astype(f)
    bias = rng.standard_normal(12).astype(f) if form == "bias relu" else None
    pool = form == "pooled"
    out = (shape[0], 12) + ((shape[2], 6, 5) if pool else shape[2:])
    start = rng.standard_normal(out).astype(f)

    def run(n, threads):
        y = start[:n].copy()
        scratch = [[np.zeros(size, f) for _ in range(threads)] for size in sizes[:3]]
        _kernels.winograd_conv(x[:n], packed, y, *scratch, pd, 1, 1, depth3, 12, form == "accumulated", bias,
                               bias is not None, threads, pool)
        return y
    for n in (1, 2, 3):
        alone = run(n, 1)
        assert np.abs(alone - start[:n]).max() > 0.1  # the kernel wrote every sample
        for threads in (n + 1, 4):
            np.testing.assert_array_equal(run(n, threads), alone, err_msg=f"{n} samples on {threads} threads")


def test_winograd_outputs_do_not_depend_on_the_block_of_tiles():
    """Blocks of one row tile of the panel GEMM (the smallest), of two, and of every tile of a
    sample (what the rule takes where the transformed weights are too large for the cache) give
    the same outputs to the bit: a tile's products are the same sums in any block of whole row
    tiles."""
    rng = np.random.default_rng(8)
    f = np.float32
    shape = (2, 10, 1, 13, 11)  # 7 x 6 tiles a sample
    x = rng.standard_normal(shape).astype(f)
    bias = rng.standard_normal(12).astype(f)
    outputs = []
    rows = _kernels.panel_tile_rows()
    for block in (rows, 2 * rows, 42):
        sizes = _kernels.winograd_workspace(10, 12, *shape[2:], 0, 1, 1, False, block, True)
        packed = np.random.default_rng(9).standard_normal(sizes[3]).astype(f)
        y = np.zeros((2, 12) + shape[2:], f)
        scratch = [[np.zeros(size, f)] for size in sizes[:3]]
        _kernels.winograd_conv(x, packed, y, *scratch, 0, 1, 1, False, block, False, bias, True, 1, False)
        outputs.append(y)
    assert np.abs(outputs[0]).max() > 0.1
    for y in outputs[1:]:
        np.testing.assert_array_equal(y, outputs[0])


# ---------------------------------------------------------------------------- any geometry

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def geometries(draw):
    """A convolution (2-D or 3-D, plain or transposed) whose kernel, stride, dilation, padding,
    groups and sizes are drawn so that each algorithm's eligibility (kernel 3 stride 1 one
    group for Winograd, kernel = stride for depth-to-space, kernel 1 for pointwise, wide rows for
    the direct kernel's tiles) comes up among the draws."""
    nd = draw(st.sampled_from([2, 3]))
    form = draw(st.sampled_from(["any", "any", "winograd", "depth to space", "pointwise"]))
    transposed = form == "depth to space" or (form == "any" and draw(st.booleans()))
    groups = 1 if form == "winograd" else draw(st.sampled_from([1, 1, 2]))
    cin, cout = groups * draw(st.integers(1, 4)), groups * draw(st.integers(1, 4))
    k = tuple(draw(st.lists(st.sampled_from([1, 2, 3]), min_size=nd, max_size=nd)))
    s = tuple(draw(st.lists(st.sampled_from([1, 1, 2, 3]), min_size=nd, max_size=nd)))
    d = tuple(draw(st.lists(st.sampled_from([1, 1, 2]), min_size=nd, max_size=nd)))
    if form == "winograd":
        k, s, d = (3,) * nd, (1,) * nd, (1,) * nd
    elif form == "depth to space":
        s, d = k, (1,) * nd
    elif form == "pointwise":
        k, s = (1,) * nd, (1,) * nd
    p = tuple(draw(st.integers(0, (kk - 1) * dd)) for kk, dd in zip(k, d))
    if form in ("depth to space", "pointwise"):
        p = (0,) * nd
    kw = dict(kernel_size=k, stride=s, padding=p, dilation=d, groups=groups, bias=draw(st.booleans()))
    if transposed:
        kw["output_padding"] = (0,) * nd if form == "depth to space" else \
            tuple(draw(st.integers(0, max(ss, dd) - 1)) for ss, dd in zip(s, d))
    sizes = [draw(st.integers(3, 7)) for _ in range(nd - 1)] + [draw(st.sampled_from([3, 5, 17, 21]))]
    layer_type = {(2, False): Conv2d, (3, False): Conv3d, (2, True): ConvTranspose2d, (3, True): ConvTranspose3d}
    return layer_type[nd, transposed], cin, cout, tuple(sizes), kw


@settings(max_examples=60, deadline=None)
@given(case=geometries(), seed=st.integers(0, 2 ** 16))
def test_any_geometry_gives_pytorchs_values_and_gradients_with_every_algorithm(case, seed):
    import torch
    F = torch.nn.functional
    layer_type, cin, cout, volume, kw = case
    try:
        layer_type(cin, cout, **kw)
    except ValueError:
        return  # a configuration PyTorch refuses too (padding past the dilated kernel, say)
    net, x, layer = conv_net(case)
    try:
        y = layer(x)
    except lm.GraphError:
        return  # the output would be empty
    net.outputs(y=y)
    net.astype("float64")
    x.requires_grad = True
    rng = np.random.default_rng(seed)
    X, G = rng.standard_normal((2,) + x.spec.shape), rng.standard_normal((2,) + y.spec.shape)
    tx = torch.from_numpy(X).requires_grad_(True)
    tw = torch.from_numpy(layer.weight.value.copy()).requires_grad_(True)
    tb = torch.from_numpy(layer.bias.value.copy()).requires_grad_(True) if layer.bias is not None else None
    conv = {Conv2d: F.conv2d, Conv3d: F.conv3d, ConvTranspose2d: F.conv_transpose2d,
            ConvTranspose3d: F.conv_transpose3d}[layer_type]
    ty = conv(tx, tw, tb, **{k: v for k, v in kw.items() if k not in ("bias", "kernel_size")})
    ty.backward(torch.from_numpy(G))
    names = cpu_conv.candidates(layer)
    try:
        for name in names:
            lm.set_conv_algorithm(name)
            net.zero_grad()
            out = net.forward({"x": X}, grad_outputs=["y"])["y"].copy()
            net.backward(grad_outputs={"y": G})
            where = f"{name} on {layer_type.__name__}({cin}, {cout}, {kw}) of {volume}"
            np.testing.assert_allclose(out, ty.detach().numpy(), rtol=1e-10, atol=1e-10, err_msg=where)
            np.testing.assert_allclose(net.grad("x"), tx.grad.numpy(), rtol=1e-10, atol=1e-10, err_msg=where)
            np.testing.assert_allclose(layer.weight.dense_grad(net.backend), tw.grad.numpy(), rtol=1e-10,
                                       atol=1e-10, err_msg=where)
            if tb is not None:
                np.testing.assert_allclose(layer.bias.dense_grad(net.backend), tb.grad.numpy(), rtol=1e-10,
                                           atol=1e-10, err_msg=where)
    finally:
        lm.set_conv_algorithm("rule")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pointwise_kernel_on_a_team_equals_the_gemm(dtype):
    """A lone sample's positions shared by the team (batch 1 at inference), against numpy's
    product with the bias and ReLU6; every thread count; sizes it refuses."""
    rng = np.random.default_rng(4)
    cout, cin, positions = 21, 19, 16 * 7 + 5
    w, x = rng.standard_normal((cout, cin)).astype(dtype), rng.standard_normal((cin, positions)).astype(dtype)
    bias = rng.standard_normal(cout).astype(dtype)
    want = np.clip(w.astype(np.float64) @ x + bias[:, None], 0, 1.5)
    tol = 1e-12 if dtype == np.float64 else 2e-5
    for threads in range(1, lm.get_num_threads() + 2):
        y = np.full((cout, positions), np.nan, dtype)
        _kernels.pointwise_conv(w, x, y, bias, 2, 1.5, threads)
        np.testing.assert_allclose(y, want, rtol=tol, atol=tol, err_msg=str(threads))
    y = np.empty((cout, positions), dtype)
    _kernels.pointwise_conv(w, x, y, None, 0, 0.0, 2)
    np.testing.assert_allclose(y, w.astype(np.float64) @ x, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="pointwise_conv: at least"):
        _kernels.pointwise_conv(w, x[:, :3].copy(), y[:, :3].copy(), None, 0, 0.0, 1)
    with pytest.raises(ValueError, match=r"pointwise_conv: y must be \(21, 117\) \(output channels, positions\), "
                                         r"found \(20, 117\)"):
        _kernels.pointwise_conv(w, x, y[1:].copy(), None, 0, 0.0, 1)
    with pytest.raises(ValueError, match=r"pointwise_conv: w \(21, 19\) x \(18, 117\): x must have w's 19 rows"):
        _kernels.pointwise_conv(w, x[1:], y, None, 0, 0.0, 1)
    with pytest.raises(ValueError, match="x must have its values along each row adjacent"):
        _kernels.pointwise_conv(w, x[:, ::2], y[:, ::2], None, 0, 0.0, 1)
    # blocks of columns of larger matrices: their own columns of y written, the rest untouched
    y = np.zeros((cout, positions), dtype)
    _kernels.pointwise_conv(w, x[:, 5:40], y[:, 50:85], bias, 1, 0.0, 2)
    np.testing.assert_allclose(y[:, 50:85], np.maximum(w.astype(np.float64) @ x[:, 5:40] + bias[:, None], 0),
                               rtol=tol, atol=tol)
    assert not y[:, :50].any() and not y[:, 85:].any()
    with pytest.raises(ValueError, match="bias must hold 21 values"):
        _kernels.pointwise_conv(w, x, y, bias[1:].copy(), 0, 0.0, 1)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_pointwise_by_positions_on_a_team_equals_the_gemm(dtype):
    """The kernel by tiles of positions against W's panels: against numpy's product with the
    bias and each activation, on teams sharing the panels of output channels (many) or the
    tiles of positions (few); sizes past whole tiles and panels; what it refuses."""
    rng = np.random.default_rng(5)
    be = lm.CPUBackend()
    tol = 1e-12 if dtype == np.float64 else 3e-5
    for cout, cin, positions in ((21, 19, 6 * 7 + 5), (70, 300, 49), (1, 1, 1), (9, 4, 3)):
        w, x = rng.standard_normal((cout, cin)).astype(dtype), rng.standard_normal((cin, positions)).astype(dtype)
        bias = rng.standard_normal(cout).astype(dtype)
        panels = be.pack_panels(w, True).panels
        product = w.astype(np.float64) @ x + bias[:, None]
        for act, cap, want in ((0, 0.0, product), (1, 0.0, np.maximum(product, 0)), (2, 1.5, np.clip(product, 0, 1.5))):
            for threads in range(1, lm.get_num_threads() + 3):
                y = np.full((cout, positions), np.nan, dtype)
                _kernels.pointwise_positions(panels, x, y, bias, act, cap, threads)
                np.testing.assert_allclose(y, want, rtol=tol, atol=tol, err_msg=f"{cout, cin, positions, act, threads}")
        y = np.empty((cout, positions), dtype)
        _kernels.pointwise_positions(panels, x, y, None, 0, 0.0, 2)
        np.testing.assert_allclose(y, product - bias[:, None], rtol=tol, atol=tol)
    with pytest.raises(ValueError, match=r"packed must hold the panels of a \(9, 4\) weight transposed"):
        _kernels.pointwise_positions(panels[1:].copy(), x, y, None, 0, 0.0, 1)
    with pytest.raises(ValueError, match=r"pointwise_positions: y must be \(9, 3\) \(output channels, positions\)"):
        _kernels.pointwise_positions(panels, x, y[:, 1:].copy(), None, 0, 0.0, 1)
    # blocks of columns of larger matrices
    big = np.zeros((9, 40), dtype)
    wide = rng.standard_normal((4, 30)).astype(dtype)
    _kernels.pointwise_positions(panels, wide[:, 3:20], big[:, 10:27], None, 0, 0.0, 2)
    np.testing.assert_allclose(big[:, 10:27], w.astype(np.float64) @ wide[:, 3:20], rtol=tol, atol=tol)
    assert not big[:, :10].any() and not big[:, 27:].any()
    with pytest.raises(ValueError, match="bias must hold 9 values"):
        _kernels.pointwise_positions(panels, x, y, bias[1:].copy(), 0, 0.0, 1)
    with pytest.raises(ValueError, match="act must be 0, 1 or 2"):
        _kernels.pointwise_positions(panels, x, y, None, 3, 0.0, 1)


def test_pointwise_by_positions_follows_the_weights_it_was_packed_from():
    """The pointwise convolution by positions multiplies by W's panels, packed once and kept
    across runs; a change of W (an optimizer step, an assignment) packs them again, in inference
    and in training."""
    rng = np.random.default_rng(6)
    layer = Conv2d(300, 10, 1)
    net = lm.Network()
    net.outputs(y=layer(net.input("x", (300, 5, 5))))
    assert cpu_pointwise.kernel(300, 25, 4) == "positions"
    x = rng.standard_normal((2, 300, 5, 5)).astype(np.float32)

    def want():
        w, b = layer.params["weight"].buffer.reshape(10, 300).astype(np.float64), layer.params["bias"].buffer
        return np.einsum("oc,ncp->nop", w, x.reshape(2, 300, 25)).reshape(2, 10, 5, 5) + b[:, None, None]

    for _ in range(2):
        np.testing.assert_allclose(net.run({"x": x})["y"], want(), rtol=2e-5, atol=2e-5)
    packs = [p for p in layer._packs.values()]
    assert [p.repacks for p in packs] == [1]
    layer.params["weight"].assign(rng.standard_normal((10, 300, 1, 1)).astype(np.float32))
    np.testing.assert_allclose(net.run({"x": x})["y"], want(), rtol=2e-5, atol=2e-5)
    assert packs[0].repacks == 2
    opt = lm.optim.SGD(net, lr=0.1)
    for step in range(2):
        out = net.forward({"x": x}, training=True, grad_outputs=["y"])
        np.testing.assert_allclose(np.asarray(out["y"]), want(), rtol=2e-5, atol=2e-5, err_msg=str(step))
        net.backward(grad_outputs={"y": np.ones((2, 10, 5, 5), np.float32)})
        opt.step()
    assert packs[0].repacks == 3  # (the second forward followed the first step)
