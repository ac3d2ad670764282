"""Model files: round trip, data only, atomic, clear errors on bad files."""
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

import lamina as lm
from lamina.io.model import ModelFileError
from lamina.layers import Dropout, Linear, SoftmaxCrossEntropy


def small_net():
    lm.manual_seed(3)
    net = lm.Network()
    x, y = net.input("x", 5), net.input("y", dtype="int32")
    enc = Linear(5, 8, activation="relu", name="enc")
    h = Dropout(0.2)(enc(x))
    dec = Linear(8, 8, name="dec")
    logits = Linear([8, 5], 3, name="head")(dec(h), x)
    net.outputs(loss=SoftmaxCrossEntropy()(logits, y), logits=logits)
    net.freeze("enc.bias")
    return net


def test_round_trip(tmp_path):
    net = small_net()
    X = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    path = tmp_path / "m.lamina"
    lm.save(net, path)
    loaded = lm.load(path)
    np.testing.assert_array_equal(loaded.run({"x": X})["logits"], net.run({"x": X})["logits"])
    assert [n for n, _ in loaded.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert loaded.layer("enc").bias.frozen and not loaded.layer("enc").weight.frozen
    assert os.listdir(tmp_path) == ["m.lamina"]  # no temporary file left behind


def test_shared_weights_survive_a_round_trip(tmp_path):
    net = lm.Network()
    x = net.input("x", 4)
    a = Linear(4, 4, name="a")
    b = Linear(4, 4, name="b")
    b.tie("weight", a.weight)
    net.outputs(y=b(a(x)))
    lm.save(net, tmp_path / "m.lamina")
    loaded = lm.load(tmp_path / "m.lamina")
    assert loaded.layer("a").weight is loaded.layer("b").weight
    assert len(loaded.parameters()) == 3


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "m.lamina"
    lm.save(small_net(), path)
    before = path.read_bytes()

    def broken_fsync(fd):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(os, "fsync", broken_fsync)
    with pytest.raises(OSError):
        lm.save(small_net(), path)
    assert path.read_bytes() == before
    assert os.listdir(tmp_path) == ["m.lamina"]


def write(path, tensors, metadata):
    save_file(tensors, str(path), metadata=metadata)


def graph_of(net):
    from lamina.io.model import describe
    return describe(net)


def test_bad_files_get_clear_errors(tmp_path):
    graph, tensors = graph_of(small_net())
    bad = tmp_path / "bad.lamina"
    with pytest.raises(ModelFileError, match="bad.lamina: cannot read"):
        lm.load(bad)
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelFileError, match="bad.lamina: not a safetensors file"):
        lm.load(bad)
    write(bad, tensors, {"format": "other", "version": "1", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="expected format 'lamina'"):
        lm.load(bad)
    write(bad, tensors, {"format": "lamina", "version": "99", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="expected format version 1, found '99'"):
        lm.load(bad)
    evil = json.loads(json.dumps(graph))
    evil["layers"][0]["kind"] = "os.system"
    write(bad, tensors, {"format": "lamina", "version": "1", "graph": json.dumps(evil)})
    with pytest.raises(ModelFileError, match="unknown kind 'os.system'"):
        lm.load(bad)
    missing = dict(tensors)
    missing.pop("enc.weight")
    write(bad, missing, {"format": "lamina", "version": "1", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="refers to tensor 'enc.weight', which the file lacks"):
        lm.load(bad)
    wrong = dict(tensors, **{"enc.weight": np.zeros((2, 2), np.float32)})
    write(bad, wrong, {"format": "lamina", "version": "1", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match=r"expected values of shape \(8, 5\), found \(2, 2\)"):
        lm.load(bad)
