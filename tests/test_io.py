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
    with pytest.raises(ModelFileError, match="bad.lamina: the header claims .* at most"):
        lm.load(bad)
    bad.write_bytes(b"\x04\x00\x00\x00\x00\x00\x00\x00{}{}")
    with pytest.raises(ModelFileError, match="bad.lamina: not a safetensors file"):
        lm.load(bad)
    write(bad, tensors, {"format": "other", "version": "1", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="expected format 'lamina'"):
        lm.load(bad)
    write(bad, tensors, {"format": "lamina", "version": "99", "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match=r"expected format version 2 \(or 1\), found '99'"):
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
    with pytest.raises(ModelFileError, match=r"layer 'enc': its configuration gives parameter 'weight' the shape \(8, 5\), the file's tensor 'enc.weight' has \(2, 2\)"):
        lm.load(bad)


def good_file(tmp_path):
    path = tmp_path / "good.lamina"
    lm.save(small_net(), path)
    return path


def test_more_bad_files(tmp_path):
    graph, tensors = graph_of(small_net())
    meta = {"format": "lamina", "version": "1"}
    bad = tmp_path / "bad.lamina"
    blob = good_file(tmp_path).read_bytes()
    bad.write_bytes(blob[:len(blob) // 2])
    with pytest.raises(ModelFileError, match="bad.lamina: (truncated|not a safetensors)"):
        lm.load(bad)
    bad.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    with pytest.raises(ModelFileError, match="header claims 1099511627776 bytes"):
        lm.load(bad)
    write(bad, dict(tensors, stray=np.zeros(3, np.float32)), {**meta, "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="tensor 'stray' belongs to no layer"):
        lm.load(bad)
    nan = dict(tensors, **{"dec.bias": np.full(8, np.nan, np.float32)})
    write(bad, nan, {**meta, "graph": json.dumps(graph)})
    with pytest.raises(ModelFileError, match="'dec.bias' contains NaN or infinity"):
        lm.load(bad)
    cycle = json.loads(json.dumps(graph))
    cycle["nodes"][0]["inputs"] = [cycle["nodes"][1]["name"]]
    write(bad, tensors, {**meta, "graph": json.dumps(cycle)})
    with pytest.raises(ModelFileError, match="cycle"):
        lm.load(bad)
    dangling = json.loads(json.dumps(graph))
    dangling["nodes"][0]["inputs"] = ["nowhere"]
    write(bad, tensors, {**meta, "graph": json.dumps(dangling)})
    with pytest.raises(ModelFileError, match="'nowhere' is not a value"):
        lm.load(bad)
    write(bad, tensors, {**meta, "graph": "[1, 2"})
    with pytest.raises(ModelFileError, match="'graph' is not JSON"):
        lm.load(bad)
    write(bad, tensors, {**meta, "graph": json.dumps({**graph, "layers": 7})})
    with pytest.raises(ModelFileError, match="'layers' must be a list"):
        lm.load(bad)


def test_fuzzed_files_fail_cleanly(tmp_path):
    """Flipped and truncated bytes of a valid file load or give a ModelFileError: never another
    exception, a crash or a hang."""
    blob = good_file(tmp_path).read_bytes()
    rng = np.random.default_rng(0)
    bad = tmp_path / "fuzz.lamina"
    outcomes = {"loaded": 0, "refused": 0}
    for trial in range(300):
        data = bytearray(blob)
        if trial % 3 == 0:
            data = data[:rng.integers(0, len(data))]
        for _ in range(rng.integers(1, 4)):
            if data:
                data[rng.integers(0, len(data))] ^= 1 << int(rng.integers(0, 8))
        bad.write_bytes(bytes(data))
        try:
            lm.load(bad)
            outcomes["loaded"] += 1
        except ModelFileError as e:
            assert "fuzz.lamina" in str(e)
            outcomes["refused"] += 1
    assert outcomes["refused"] > 100


def test_half_precision_and_assets(tmp_path):
    net = small_net()
    net.assets = {"vocabulary": ["a", "b"], "mean": np.array([0.5, 2.0], np.float32)}
    X = np.random.default_rng(0).standard_normal((4, 5)).astype(np.float32)
    lm.save(net, tmp_path / "half.lamina", half=True)
    lm.save(net, tmp_path / "full.lamina")
    saved = os.path.getsize(tmp_path / "full.lamina") - os.path.getsize(tmp_path / "half.lamina")
    assert saved >= 2 * sum(p.size for p in net.parameters()) - 64  # 2 bytes per value (headers differ)
    loaded = lm.load(tmp_path / "half.lamina")
    assert loaded.layer("enc").weight.dtype == np.float32
    np.testing.assert_array_equal(loaded.layer("enc").weight.value,
                                  net.layer("enc").weight.value.astype(np.float16).astype(np.float32))
    for p in net.parameters():  # the same network with its values rounded to float16 as stored
        p.assign(p.value.astype(np.float16).astype(np.float32))
    np.testing.assert_array_equal(loaded.run({"x": X})["logits"], net.run({"x": X})["logits"])
    assert loaded.assets["vocabulary"] == ["a", "b"]
    np.testing.assert_array_equal(loaded.assets["mean"], [0.5, 2.0])


def test_a_killed_save_leaves_the_old_file(tmp_path):
    """A process killed while it writes a big model leaves the previous file as it was. The kill
    is sent while the writer's temporary file exists, and the test checks that it left one
    behind (the kill hit a write), retrying until it does."""
    import signal
    import subprocess
    import sys
    import time
    path = tmp_path / "m.lamina"
    lm.save(small_net(), path)
    before = path.read_bytes()
    script = (f"import lamina as lm, sys\n"
              f"net = lm.Network(); x = net.input('x', 4000)\n"
              f"net.outputs(y=lm.layers.Linear(4000, 4000)(x))\n"
              f"print('ready', flush=True)\n"
              f"while True: lm.save(net, {str(path)!r})\n")
    for attempt in range(10):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while not list(tmp_path.glob(".tmp-*")) and time.monotonic() < deadline:
            time.sleep(0.001)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        leftovers = list(tmp_path.glob(".tmp-*"))
        after = path.read_bytes()
        assert after == before or lm.load(path).layer("linear0").weight.shape == (4000, 4000)
        for leftover in leftovers:
            leftover.unlink()  # the killed writer's temporary file: never the model itself
        lm.load(path)
        if leftovers:
            break
    assert leftovers, "no kill landed during a write in 10 attempts"


def test_hostile_sizes_are_refused_before_anything_is_allocated(tmp_path):
    """A 100 kB file whose configuration claims 2e7 output channels is refused at once, in
    little memory (the configured shapes are checked against the tensors before allocation)."""
    import resource
    import time
    net = lm.Network()
    x = net.input("x", (2, 4, 4, 4))
    net.outputs(y=lm.layers.Conv3d(2, 3, 3, name="conv")(x))
    graph, tensors = graph_of(net)
    graph["layers"][0]["config"]["out_channels"] = 20_000_000
    write(tmp_path / "huge.lamina", tensors, {"format": "lamina", "version": "1", "graph": json.dumps(graph)})
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    with pytest.raises(ModelFileError, match=r"layer 'conv': its configuration gives parameter 'weight' the "
                                             r"shape \(20000000, 2, 3, 3, 3\)"):
        lm.load(tmp_path / "huge.lamina")
    assert time.perf_counter() - start < 2
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - peak < 100_000  # kB: no gigabytes


def test_deep_nesting_is_refused(tmp_path):
    graph, tensors = graph_of(small_net())
    meta = {"format": "lamina", "version": "1", "graph": json.dumps(graph)}
    deep = "[" * 100_000 + "]" * 100_000
    for key in ("graph", "assets"):
        write(tmp_path / "deep.lamina", tensors, {**meta, key: deep})
        with pytest.raises(ModelFileError, match=f"the metadata's '{key}' is (nested|not JSON of a sane depth)"):
            lm.load(tmp_path / "deep.lamina")
    nested = json.loads(json.dumps(graph))
    nested["layers"][0]["config"]["extra"] = json.loads("[" * 40 + "]" * 40)
    write(tmp_path / "deep.lamina", tensors, {**meta, "graph": json.dumps(nested)})
    with pytest.raises(ModelFileError, match="nested more than 32 levels deep"):
        lm.load(tmp_path / "deep.lamina")


def test_flipped_bits_in_the_tensor_data_are_found(tmp_path):
    path = good_file(tmp_path)
    blob = bytearray(path.read_bytes())
    start = 8 + int.from_bytes(blob[:8], "little")  # the tensor data follows the header
    rng = np.random.default_rng(1)
    for at in rng.integers(start, len(blob), size=200):
        blob[at] ^= 1 << int(rng.integers(0, 8))
    (tmp_path / "flipped.lamina").write_bytes(bytes(blob))
    with pytest.raises(ModelFileError, match="flipped.lamina: the file's content does not match the digest"):
        lm.load(tmp_path / "flipped.lamina")
    one = bytearray(path.read_bytes())
    one[len(one) - 3] ^= 1  # a single bit of the last tensor
    (tmp_path / "one.lamina").write_bytes(bytes(one))
    with pytest.raises(ModelFileError, match="does not match the digest"):
        lm.load(tmp_path / "one.lamina")


def header_and_tensors(path):
    from lamina.io.model import _read
    metadata, tensors = _read(path)
    return metadata, {k: v.tobytes() for k, v in tensors.items()}


@pytest.mark.parametrize("name, every_byte", [("denoise3d", True), ("python_lm", False)])
def test_flipped_bits_in_a_shipped_models_header_never_load_silently(tmp_path, name, every_byte):
    """The digest covers the header (graph, assets, format) too: one flipped bit of the JSON
    header is refused, or (never seen) loads as exactly the original content."""
    from pathlib import Path
    source = Path(__file__).resolve().parents[1] / "models" / name / "model.lamina"
    blob = source.read_bytes()
    header_end = 8 + int.from_bytes(blob[:8], "little")
    original = header_and_tensors(source)
    rng = np.random.default_rng(5)
    places = range(header_end) if every_byte else rng.integers(0, header_end, size=600)
    bad, refused = tmp_path / "flip.lamina", 0
    for at in places:
        data = bytearray(blob)
        data[at] ^= 1 << int(at % 8 if every_byte else rng.integers(0, 8))
        bad.write_bytes(bytes(data))
        try:
            loaded = header_and_tensors(bad)
        except ModelFileError as e:
            assert "flip.lamina" in str(e)
            refused += 1
            continue
        assert loaded == original, f"a flipped bit at byte {at} of the header loaded as other content"
    assert refused == len(places)


def test_a_rewired_graph_or_edited_vocabulary_is_refused(tmp_path):
    from lamina.io.model import _read
    net = small_net()
    net.assets["vocab"] = ["struct", "class"]
    path = tmp_path / "m.lamina"
    lm.save(net, path)
    metadata, tensors = _read(path)
    for key, old, new in (("graph", '"inputs": ["h"]', '"inputs": ["x"]'), ("assets", "struct", "s4ruct")):
        edited = {**metadata}
        if key == "graph":  # dec reads enc's output (through dropout); make it read x
            graph = json.loads(edited["graph"])
            node = next(n for n in graph["nodes"] if n["layer"] == "dec")
            node["inputs"] = ["enc"]
            edited["graph"] = json.dumps(graph)
        else:
            edited[key] = edited[key].replace(old, new)
        assert edited != metadata
        write(tmp_path / "edited.lamina", tensors, edited)
        with pytest.raises(ModelFileError, match="edited.lamina: the file's content does not match the digest"):
            lm.load(tmp_path / "edited.lamina")
    without = {k: v for k, v in metadata.items() if k != "digest"}
    write(tmp_path / "bare.lamina", tensors, without)
    with pytest.raises(ModelFileError, match="bare.lamina: the metadata has no 'digest'; every version 2 file"):
        lm.load(tmp_path / "bare.lamina")
    write(tmp_path / "renamed.lamina", tensors, {**without, "digesT": metadata["digest"]})
    with pytest.raises(ModelFileError, match="has no 'digest'"):
        lm.load(tmp_path / "renamed.lamina")


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_non_finite_configuration_values_are_refused(tmp_path, value):
    from lamina.io import load_description
    graph, tensors = graph_of(small_net())
    text = json.dumps(graph).replace('"p": 0.2', f'"p": {value}')
    assert text != json.dumps(graph)
    write(tmp_path / "nan.lamina", tensors, {"format": "lamina", "version": "1", "graph": text})
    with pytest.raises(ModelFileError, match="nan.lamina: the metadata's 'graph' (is not JSON|holds the non-finite)"):
        lm.load(tmp_path / "nan.lamina")
    description = tmp_path / "nan.json"
    description.write_text(json.dumps({"format": "lamina", "version": 2, "graph": json.loads(json.dumps(graph))})
                           .replace('"p": 0.2', f'"p": {value}'))
    with pytest.raises(ModelFileError, match="nan.json: the description (is not JSON|holds the non-finite)"):
        load_description(description)


def test_a_tensor_of_another_type_is_refused_by_name(tmp_path):
    import struct
    header = json.dumps({"__metadata__": {"format": "lamina", "version": "2"},
                         "enc.weight": {"dtype": "F8_E4M3", "shape": [2], "data_offsets": [0, 2]}}).encode()
    (tmp_path / "f8.lamina").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    with pytest.raises(ModelFileError, match="f8.lamina: tensor 'enc.weight' has type 'F8_E4M3'.*BF16 or I8"):
        lm.load(tmp_path / "f8.lamina")


def test_files_written_before_digests_still_load(tmp_path):
    net = small_net()
    graph, tensors = graph_of(net)
    write(tmp_path / "old.lamina", tensors, {"format": "lamina", "version": "1", "graph": json.dumps(graph)})
    X = np.ones((2, 5), np.float32)
    np.testing.assert_array_equal(lm.load(tmp_path / "old.lamina").run({"x": X})["logits"],
                                  net.run({"x": X})["logits"])


def test_saving_refuses_non_finite_values_and_keeps_the_old_file(tmp_path):
    from lamina.io.model import NonFiniteModelError
    net = small_net()
    path = tmp_path / "m.lamina"
    lm.save(net, path)
    before = path.read_bytes()
    net.layer("dec").bias.buffer[3] = np.nan  # as a diverged training run would leave it
    with pytest.raises(NonFiniteModelError, match="parameter 'dec.bias' holds NaN or infinity"):
        lm.save(net, path)
    net.layer("dec").bias.assign(np.full(8, 1e5))
    with pytest.raises(NonFiniteModelError, match="exceeds float16's range"):
        lm.save(net, path, half=True)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["m.lamina"]


def test_checkpoint_resume_is_exact(tmp_path):
    """5 steps, checkpoint, resume, 5 steps == 10 steps straight (dropout included)."""
    rng = np.random.default_rng(0)
    batches = [(rng.standard_normal((16, 5)).astype(np.float32), rng.integers(0, 3, 16).astype(np.int32))
               for _ in range(10)]

    def make_opt(net):
        return lm.optim.Adam(net, lr=0.01, schedule=lm.optim.CosineWarmup(2, 10))

    straight = small_net()
    opt = make_opt(straight)
    for x, y in batches:
        straight.train_step({"x": x, "y": y}, opt)

    first = small_net()
    opt = make_opt(first)
    for x, y in batches[:5]:
        first.train_step({"x": x, "y": y}, opt)
    lm.save_checkpoint(tmp_path / "ck.lamina", first, opt, batch=5)
    ck = lm.load_checkpoint(tmp_path / "ck.lamina")
    assert ck.fields == {"batch": 5} and ck.step_count == 5
    resumed = ck.net
    opt = ck.restore(make_opt(resumed))
    for x, y in batches[ck.fields["batch"]:]:
        resumed.train_step({"x": x, "y": y}, opt)
    for (name, a), (_, b) in zip(straight.named_parameters(), resumed.named_parameters()):
        np.testing.assert_array_equal(a.value, b.value, err_msg=name)
    with pytest.raises(ModelFileError, match="holds Adam state, the optimizer is SGD"):
        ck.restore(lm.optim.SGD(resumed, lr=0.1))
    with pytest.raises(ModelFileError, match="a model file, not a checkpoint"):
        lm.load_checkpoint(good_file(tmp_path))


# ---------------------------------------------------------------------------- property-based

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from helpers import json_places, json_values, replace_at  # noqa: E402


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_edit_of_a_graph_with_a_valid_digest_loads_or_is_refused_cleanly(tmp_path, data):
    """A file whose graph was edited at a random place (a value replaced by random JSON) and
    whose digest was then recomputed, as a buggy or hostile writer would: the loader either
    builds a valid network or raises ModelFileError naming the file; never another exception."""
    from lamina.io.model import FORMAT, VERSION, digest
    graph, tensors = graph_of(small_net())
    place = data.draw(st.sampled_from(list(json_places(graph))[1:]))
    edited = json.loads(json.dumps(graph))
    replace_at(edited, place, data.draw(json_values()))
    metadata = {"format": FORMAT, "version": str(VERSION), "graph": json.dumps(edited), "assets": "{}"}
    metadata["digest"] = digest(tensors, metadata)
    path = tmp_path / "edited.lamina"
    write(path, tensors, metadata)
    try:
        net = lm.load(path)
    except ModelFileError as e:
        assert "edited.lamina" in str(e)
        return
    net.validate()


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(edits=st.lists(st.tuples(st.integers(0, 10 ** 6), st.integers(0, 255), st.sampled_from(["set", "cut", "add"])),
                      min_size=1, max_size=4))
def test_any_mutation_of_a_model_file_is_refused_or_loads_the_same_content(tmp_path, edits):
    from lamina.io.model import _read
    source = good_file(tmp_path)
    blob = bytearray(source.read_bytes())
    for at, byte, how in edits:
        at %= max(len(blob), 1)
        if how == "set" and blob:
            blob[at] = byte
        elif how == "cut":
            del blob[at:]
        else:
            blob[at:at] = bytes([byte])
    path = tmp_path / "mutated.lamina"
    path.write_bytes(bytes(blob))
    try:
        metadata, tensors = _read(path)
        lm.load(path)
    except ModelFileError as e:
        assert "mutated.lamina" in str(e)
        return
    original_metadata, original_tensors = _read(source)
    assert metadata == original_metadata
    assert {k: v.tobytes() for k, v in tensors.items()} == {k: v.tobytes() for k, v in original_tensors.items()}
