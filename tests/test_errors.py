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
    with pytest.raises(lm.InputError, match="input 'y': expected integer ids \\(int32\\), found float32"):
        classifier().forward({"x": np.zeros((2, 4), np.float32), "y": np.zeros(2, np.float32)})


def test_integer_ids_of_any_type_are_narrowed_only_when_they_fit():
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    net = classifier()
    expected = net.forward({"x": x, "y": np.array([0, 2, 1], np.int32)})["loss"].copy()
    for dtype in (np.int64, np.uint8, np.int16):
        got = net.forward({"x": x, "y": np.array([0, 2, 1], dtype)})["loss"]
        np.testing.assert_array_equal(got, expected)
    # 2**32 + 2 would wrap to 2, a valid class: refused, not narrowed
    with pytest.raises(lm.InputError, match=r"input 'y': ids must fit int32 .*found 4294967298 at position 1"):
        net.forward({"x": x, "y": np.array([0, 2 ** 32 + 2, 1], np.int64)})


def test_read_only_strided_and_fortran_inputs_are_accepted():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    net = classifier()
    expected = net.run({"x": x})["logits"]
    read_only = x.copy()
    read_only.flags.writeable = False
    wide = np.zeros((6, 8), np.float32)
    wide[:, ::2] = x
    swapped = x.astype(x.dtype.newbyteorder(">"))
    for variant in (read_only, wide[:, ::2], np.asfortranarray(x), x[::-1][::-1], swapped):
        np.testing.assert_array_equal(net.run({"x": variant})["logits"], expected)
    y = np.array([0, 1, 2, 0, 1, 2], np.int32)
    y.flags.writeable = False
    loss = net.forward({"x": read_only, "y": y})["loss"].copy()
    np.testing.assert_array_equal(loss, net.forward({"x": x, "y": y.copy()})["loss"])


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


def test_label_out_of_range_names_the_layer():
    with pytest.raises(lm.InputError, match=r"layer 'xent' .*labels \(input 1\) must lie in \[0, 3\), found 7 at row 1"):
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
    with pytest.raises(ValueError, match="unknown activation 'swish'"):
        Linear(2, 2, activation="swish")
