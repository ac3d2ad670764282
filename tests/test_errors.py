"""Bad input gets an error that names where it is and what was expected; never a crash."""
import numpy as np
import pytest

import lamina as lm
from lamina.layers import Concat, Linear, SoftmaxCrossEntropy


def classifier():
    net = lm.Network()
    x, y = net.input("x", 4), net.input("y", dtype="int32")
    logits = Linear(4, 3, name="fc")(x)
    net.outputs(loss=SoftmaxCrossEntropy(name="xent")(logits, y), logits=logits)
    return net


def test_wrong_dtype():
    with pytest.raises(lm.InputError, match="input 'x': expected dtype float32, found float64"):
        classifier().run({"x": np.zeros((2, 4))})
    with pytest.raises(lm.InputError, match="input 'y': expected dtype int32, found int64"):
        classifier().forward({"x": np.zeros((2, 4), np.float32), "y": np.zeros(2, np.int64)})


def test_non_contiguous_input():
    with pytest.raises(lm.InputError, match="input 'x': expected a C-contiguous array"):
        classifier().run({"x": np.zeros((4, 2), np.float32).T})


def test_wrong_input_shape():
    with pytest.raises(lm.InputError, match=r"input 'x': expected shape \(batch, 4\).*found \(2, 5\)"):
        classifier().run({"x": np.zeros((2, 5), np.float32)})


def test_inconsistent_batch():
    with pytest.raises(lm.InputError, match="input 'y': batch size 3 differs"):
        classifier().forward({"x": np.zeros((2, 4), np.float32), "y": np.zeros(3, np.int32)})


def test_unknown_and_missing_inputs():
    with pytest.raises(lm.InputError, match="unknown input 'z'; this network's inputs are 'x', 'y'"):
        classifier().run({"z": np.zeros((2, 4), np.float32)})
    with pytest.raises(lm.InputError, match="missing input 'y'"):
        classifier().forward({"x": np.zeros((2, 4), np.float32)})
    with pytest.raises(lm.InputError, match="unknown output 'probs'"):
        classifier().run({"x": np.zeros((2, 4), np.float32)}, outputs=["probs"])


def test_label_out_of_range_names_the_kernel():
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\), found 7"):
        classifier().forward({"x": np.zeros((2, 4), np.float32), "y": np.array([0, 7], np.int32)})


def test_shape_mismatch_names_the_layer():
    net = lm.Network()
    x = net.input("x", 5)
    with pytest.raises(lm.GraphError, match=r"layer 'fc' \(Linear\): input 0 has 5 features, expected in_features=4"):
        Linear(4, 3, name="fc")(x)


def test_float_layer_fed_int_names_the_layer():
    net = lm.Network()
    ids = net.input("ids", 4, dtype="int32")
    with pytest.raises(lm.GraphError, match=r"layer 'cat' \(Concat\): input 0 must be float"):
        Concat(name="cat")(ids)


def test_unknown_input_name_in_add():
    net = lm.Network()
    net.input("x", 4)
    net.add(Linear(4, 2, name="fc"), ["x_typo"])
    net.outputs(y="fc")
    with pytest.raises(lm.GraphError, match=r"layer 'fc' \(Linear\): input 0 'x_typo' is not a value"):
        net.run({"x": np.zeros((1, 4), np.float32)})


def test_cycle_is_reported_with_its_layers():
    net = lm.Network()
    net.input("x", 4)
    net.add(Linear([4, 4], 4, name="a"), ["x", "b"])
    net.add(Linear(4, 4, name="b"), ["a"])
    net.outputs(y="b")
    with pytest.raises(lm.GraphError, match="cycle through layers a, b"):
        net.validate()


def test_duplicate_names_and_missing_outputs():
    net = lm.Network()
    net.input("x", 4)
    with pytest.raises(lm.GraphError, match="the name 'x' is already used"):
        net.input("x", 2)
    with pytest.raises(lm.GraphError, match="network has no outputs"):
        net.validate()


def test_backward_needs_a_cost_and_a_forward():
    net = lm.Network()
    net.outputs(y=Linear(2, 2)(net.input("x", 2)))
    with pytest.raises(lm.GraphError, match="backward needs a training forward first"):
        net.backward()
    net.forward({"x": np.zeros((1, 2), np.float32)})
    with pytest.raises(lm.GraphError, match="backward needs a cost"):
        net.backward()


def test_parameter_values_are_read_only_and_assign_checks():
    fc = Linear(3, 2)
    with pytest.raises(ValueError, match="read-only"):
        fc.weight.value[0, 0] = 1.0
    with pytest.raises(ValueError, match=r"expected values of shape \(2, 3\), found \(3, 2\)"):
        fc.weight.assign(np.zeros((3, 2)))
    with pytest.raises(ValueError, match="NaN"):
        fc.weight.assign(np.full((2, 3), np.nan))


def test_bad_layer_arguments():
    with pytest.raises(ValueError, match="Linear: sizes must be at least 1"):
        Linear(0, 3)
    with pytest.raises(ValueError, match=r"Dropout: p must be in \[0, 1\), found 1.5"):
        lm.layers.Dropout(1.5)
    with pytest.raises(ValueError, match="unknown activation 'gelu'"):
        Linear(2, 2, activation="gelu")
