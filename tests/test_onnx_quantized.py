"""Quantized ONNX models (lamina.io.onnx.quantized): what ONNX Runtime's own quantizer writes
(dynamic: DynamicQuantizeLinear + MatMulInteger / ConvInteger, DynamicQuantizeLSTM; static QDQ
per channel) loads as an int8 network that agrees with ONNX Runtime running it, and an int8
network exports in the QDQ form (int8 weights with DequantizeLinear) that ONNX Runtime runs.

Bounds. lamina quantizes activations per row and weights per output channel, ONNX Runtime per
tensor: the two int8 computations differ by about their quantization errors, each about what the
int8 model moves from the float one. Each test measures that move (ONNX Runtime int8 against
ONNX Runtime float32) and holds lamina within three times it."""
import numpy as np
import pytest

import lamina as lm

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
quantization = pytest.importorskip("onnxruntime.quantization")


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c, self.f = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Linear(8 * 8 * 8, 5)

    def forward(self, x):
        return self.f(torch.relu(self.c(x)).flatten(1))


class Recurrent(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.l, self.o = torch.nn.LSTM(8, 16, batch_first=True), torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.o(self.l(x)[1][0][-1])


MODELS = {"mlp": (MLP, (2, 16), {0: "N"}), "cnn": (CNN, (2, 3, 8, 8), {0: "N"}),
          "lstm": (Recurrent, (2, 5, 8), {0: "N", 1: "T"})}


def export(tmp_path, kind):
    make, shape, axes = MODELS[kind]
    torch.manual_seed(0)
    path = tmp_path / f"{kind}.onnx"
    torch.onnx.export(make().eval(), (torch.randn(*shape),), str(path), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": axes})
    return path


def sample(kind, rows=4):
    shape = list(MODELS[kind][1])
    shape[0] = rows
    if kind == "lstm":
        shape[1] = 6
    return np.random.default_rng(1).standard_normal(shape).astype(np.float32)


def compare(float_path, quantized_path, x):
    net = lm.onnx.load(quantized_path)
    got = np.asarray(net.run(lm.onnx.feeds(net, {"x": x}))["y"])
    want = ort.InferenceSession(str(quantized_path)).run(None, {"x": x})[0]
    full = ort.InferenceSession(str(float_path)).run(None, {"x": x})[0]
    move = np.abs(want - full).max()
    assert move > 0  # ONNX Runtime did run the model quantized
    # ONNX Runtime's activations take 255 steps; lamina's int8_activation_levels (127 on its own
    # int8 panels, whose int16 pair sums must not saturate): the rounding grows with the step
    # (on a CPU with VNNI, ONNX Runtime's own error is the smaller, so the bound scales)
    bound = 3 * move * 255 / net.backend.int8_activation_levels
    assert np.abs(got - want).max() <= bound, (np.abs(got - want).max(), move, net.backend.int8_activation_levels)
    assert np.abs(got - full).max() <= bound
    return net


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_onnx_runtime_dynamic_quantization_loads_as_an_int8_network(tmp_path, kind):
    path = export(tmp_path, kind)
    quantized = tmp_path / f"{kind}8.onnx"
    quantization.quantize_dynamic(str(path), str(quantized), weight_type=quantization.QuantType.QInt8)
    import onnx
    ops = {n.op_type for n in onnx.load(str(quantized)).graph.node}
    expected = {"mlp": "MatMulInteger", "cnn": "ConvInteger", "lstm": "DynamicQuantizeLSTM"}[kind]
    assert expected in ops and (kind == "lstm" or "DynamicQuantizeLinear" in ops)
    net = compare(path, quantized, sample(kind))
    assert net.precision == "int8"


@pytest.mark.parametrize("kind", ["mlp", "cnn"])
def test_a_static_qdq_model_per_channel_loads_as_an_int8_network(tmp_path, kind):
    """QuantizeLinear/DequantizeLinear around every activation, int8 weights per channel; the
    quantizer folds the Relu into the range of the QuantizeLinear after it (zero point 0 of a u8):
    lamina keeps that Relu."""
    path = export(tmp_path, kind)
    rng = np.random.default_rng(2)

    class Reader(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": sample(kind, 1) + rng.standard_normal(sample(kind, 1).shape).astype(np.float32)}
                                 for _ in range(8)])

        def get_next(self):
            return next(self.batches, None)

    quantized = tmp_path / f"{kind}_qdq.onnx"
    quantization.quantize_static(str(path), str(quantized), Reader(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True, weight_type=quantization.QuantType.QInt8)
    import onnx
    ops = [n.op_type for n in onnx.load(str(quantized)).graph.node]
    assert "QuantizeLinear" in ops and "Relu" not in ops  # the Relu went into a quantization range
    net = compare(path, quantized, sample(kind))
    assert net.precision == "int8"


def test_an_int8_network_exports_its_int8_weights_in_qdq_form(tmp_path):
    lm.manual_seed(0)
    net = lm.Network()
    x = net.input("x", 8, sequence=True)
    y = lm.layers.LSTM(8, 16, bidirectional=True)(x)[0]
    net.outputs(out=lm.layers.Linear(32, 3)(y))
    lm.quantize(net)
    model = lm.onnx.save(net, tmp_path / "q8.onnx")
    import onnx
    int8 = [i for i in model.graph.initializer if i.data_type == onnx.TensorProto.INT8]
    assert len(int8) == 3 and all(any(i.name in n.input for n in model.graph.node if n.op_type == "DequantizeLinear")
                                  for i in int8)
    floats = [i.name for i in model.graph.initializer if i.data_type == onnx.TensorProto.FLOAT]
    assert all(("scale" in n) or (".B_" in n) or ("bias" in n) for n in floats), floats  # no weight in float32
    rng = np.random.default_rng(3)
    seqs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (5, 3, 7)]
    ours = net.run({"x": lm.Sequences.from_list(seqs)})["out"].values
    padded, lengths = np.zeros((3, 7, 8), np.float32), np.array([5, 3, 7])
    for i, s in enumerate(seqs):
        padded[i, :len(s)] = s
    def theirs(level):
        options = ort.SessionOptions()
        options.graph_optimization_level = level
        out = ort.InferenceSession(str(tmp_path / "q8.onnx"), options).run(None, {"x": padded, "lengths": lengths})[0]
        return np.concatenate([out[i, :n] for i, n in enumerate(lengths)])
    # without graph optimizations ONNX Runtime multiplies float32 activations by the dequantized
    # weights: lamina's numbers in float32 over the same weights, to float32 rounding
    unquantized = lm.onnx.load(tmp_path / "q8.onnx").set_precision("float32")
    float32 = unquantized.run(lm.onnx.feeds(unquantized, {"x": padded, "lengths": lengths}))["out"].values
    np.testing.assert_allclose(theirs(ort.GraphOptimizationLevel.ORT_DISABLE_ALL), float32, rtol=0, atol=1e-5)
    # by default it fuses DequantizeLinear + MatMul into an int8 product of its own (activations
    # quantized per tensor): both int8 results lie within their moves from float32
    quantized = theirs(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
    move = np.abs(quantized - float32).max()
    assert move > 1e-5 and np.abs(ours - float32).max() > 1e-5
    assert np.abs(ours - quantized).max() <= 3 * max(move, np.abs(ours - float32).max())
    back = lm.onnx.load(tmp_path / "q8.onnx")
    assert back.precision == "int8"
    again = back.run(lm.onnx.feeds(back, {"x": padded, "lengths": lengths}))["out"].values
    np.testing.assert_allclose(again, ours, rtol=0, atol=1e-5)


def test_a_quantized_tensor_read_elsewhere_is_refused_by_name(tmp_path):
    import onnx
    from onnx import TensorProto, helper
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"], name="quantize"),
             helper.make_node("Cast", ["q"], ["f"], name="widen", to=TensorProto.FLOAT)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("f", TensorProto.FLOAT, ["N", 4])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)]), tmp_path / "bad.onnx")
    with pytest.raises(lm.UnsupportedModelError, match="node 'widen' \\(Cast\\): a cast of a quantized tensor"):
        lm.onnx.load(tmp_path / "bad.onnx")
