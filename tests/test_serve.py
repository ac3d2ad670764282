"""`lamina serve`, run for real: a server process on a free port, spoken to over HTTP by httpx
and lamina.serve.Client. Every route; answers equal net.run on the same inputs; concurrent
sequences of different lengths are batched together and each gets its own rows; every kind of
bad input gets the protocol's error body while the others in its batch are answered; deadlines;
SIGTERM under load loses no accepted request."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

import lamina as lm
from lamina.serve import Client, ServerError
from lamina.serve.client import encode_request

from test_cli import classifier

ROOT = Path(__file__).resolve().parent.parent
LM = ROOT / "models" / "python_lm" / "model.lamina"
DENOISER = ROOT / "models" / "denoise3d" / "model.lamina"


class Server:
    """A `lamina serve` process; `url` once it listens."""

    def __init__(self, *args, blas=None, **popen):
        env = {**os.environ, "LAMINA_THREADS": "1", **({"LAMINA_BLAS": blas} if blas else {})}
        self.proc = subprocess.Popen([sys.executable, "-m", "lamina.cli", "serve", *args, "--port", "0"],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     stdin=subprocess.DEVNULL, env=env, **popen)
        line = self.proc.stdout.readline()
        match = re.search(r"http://[\d.]+:\d+", line)
        if not match:
            self.proc.kill()
            raise AssertionError(f"the server did not start: {line}{self.proc.stderr.read()}")
        self.url = match.group(0)
        grpc = re.search(r"grpc://([\d.]+:\d+)", line)
        self.grpc = grpc.group(1) if grpc else None  # host:port of the gRPC service (--grpc-port)
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def stop(self):
        """SIGTERM; True when the server shut down cleanly (a graceful stop exits 0) with
        nothing on stderr but warnings."""
        self.http.close()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(30)
        err = self.proc.stderr.read()
        if self.proc.returncode != 0 or "Traceback" in err:
            print(f"server exit status {self.proc.returncode}; stderr:\n{err[-3000:]}")
        return self.proc.returncode == 0 and "Traceback" not in err


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    folder = tmp_path_factory.mktemp("models")
    classifier(folder / "clf.lamina")
    return {"clf": folder / "clf.lamina", "lm": LM, "denoise3d": DENOISER}


@pytest.fixture(scope="module")
def server(models):
    s = Server(f"clf={models['clf']}", str(LM), str(DENOISER), "--max-delay-ms", "30", "--max-body-mb", "1")
    yield s
    assert s.stop()


def lm_request(ids):
    z = np.zeros((1, 1, 256), np.float32)
    return {"ids": ids, "h0": z, "c0": z}


def lm_reference(net, ids, following=None):
    """net.run on one sequence; with the tokens that follow each step, their scores (nll) too."""
    z = np.zeros((1, 1, 256), np.float32)
    one = lambda steps: lm.Sequences(steps, np.array([0, len(steps)], np.int32))
    feeds = {"ids": one(ids), "h0": z, "c0": z}
    if following is not None:
        feeds["next"] = one(following)
    out = net.run(feeds, ["logits", "last", "cell"] + (["nll"] if following is not None else []))
    return {k: v.values if isinstance(v, lm.Sequences) else v for k, v in out.items()}


def test_routes(server):
    h = server.http
    assert h.get("/v2/health/live").json() == {"live": True}
    assert h.get("/v2/health/ready").json() == {"ready": True}
    meta = h.get("/v2").json()
    assert meta["extensions"] == ["binary_tensor_data", "classification", "model_configuration", "model_repository",
                                  "statistics"] and meta["models"] == ["clf", "denoise3d", "python_lm"]
    lm_meta = h.get("/v2/models/python_lm").json()
    assert lm_meta["inputs"] == [
        {"name": "ids", "datatype": "INT32", "shape": [-1], "parameters": {"sequence": True}},
        {"name": "h0", "datatype": "FP32", "shape": [-1, 1, 256], "parameters": {"optional": True}},
        {"name": "c0", "datatype": "FP32", "shape": [-1, 1, 256], "parameters": {"optional": True}},
        {"name": "next", "datatype": "INT32", "shape": [-1], "parameters": {"sequence": True}}]
    assert [o["name"] for o in lm_meta["outputs"]] == ["logits", "nll", "last", "cell"]
    assert lm_meta["outputs"][0] == {"name": "logits", "datatype": "FP32", "shape": [-1, 4096],
                                     "parameters": {"sequence": True, "inputs": ["ids", "h0", "c0"]}}
    assert lm_meta["outputs"][1]["parameters"]["inputs"] == ["ids", "h0", "c0", "next"]
    assert lm_meta["outputs"][2] == {"name": "last", "datatype": "FP32", "shape": [-1, 1, 256],
                                     "parameters": {"inputs": ["ids", "h0", "c0"]}}
    assert h.get("/v2/models/denoise3d").json()["inputs"] == [
        {"name": "noisy", "datatype": "FP32", "shape": [-1, 1, 24, 24, 24]}]
    assert h.get("/v2/models/clf/ready").status_code == 200
    r = h.get("/v2/models/nope")
    assert r.status_code == 404 and "unknown model 'nope'" in r.json()["error"]
    metrics = h.get("/metrics").text
    assert 'lamina_queued_requests{model="python_lm"} 0.0' in metrics
    for name in ("lamina_requests_total", "lamina_batch_size", "lamina_queue_seconds", "lamina_compute_seconds"):
        assert f"# TYPE {name.replace('_total', '')}" in metrics


def assert_close(got, want, rel, what=""):
    """|got - want| <= rel x max |want|: float32 sums in another order (the server's thread
    count, a batch's GEMM blocking) round differently, within a bound of the output's scale."""
    assert got.shape == want.shape, (what, got.shape, want.shape)
    scale = float(np.abs(want).max())
    worst = float(np.abs(got - want).max())
    assert worst <= rel * scale, f"{what}: off by {worst:.3g}, {worst / scale:.3g} of the scale {scale:.3g}"


@pytest.mark.parametrize("binary", [True, False])
def test_answers_equal_net_run(server, models, binary):
    """A lone request against net.run in this process: within 1e-6 of each output's scale (the
    server runs 1 thread, this process may run more)."""
    client = Client(server.url)
    clf = lm.load(models["clf"])
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    out = client.infer("clf", {"x": x}, outputs=["logits"], binary=binary)
    assert_close(out["logits"], clf.run({"x": x})["logits"], 1e-6, "clf")
    net = lm.load(LM)
    ids = np.random.default_rng(2).integers(0, 4096, 37).astype(np.int32)
    out = client.infer("python_lm", lm_request(ids), binary=binary)
    want = lm_reference(net, ids)
    for name in ("logits", "last", "cell"):
        assert_close(out[name], want[name], 1e-6, name)
    noisy = np.random.default_rng(3).standard_normal((1, 1, 24, 24, 24)).astype(np.float32)
    out = client.infer("denoise3d", {"noisy": noisy}, binary=binary)
    assert_close(out["denoised"], lm.load(DENOISER).run({"noisy": noisy})["denoised"], 1e-6, "denoised")


def batch_sizes(http, model):
    """(batches run, requests in them) so far (a model without a batch has no line yet)."""
    text = http.get("/metrics").text
    found = [re.search(rf'lamina_batch_size_{kind}{{model="{model}"}} (\S+)', text) for kind in ("count", "sum")]
    return tuple(float(m.group(1)) if m else 0.0 for m in found)


def infer_concurrently(server, requests, outputs, threads):
    """Each request to the language model from a pool of `threads` threads, a client each: the
    answers, and the mean size of the batches they ran in (from /metrics)."""
    count0, total0 = batch_sizes(server.http, "python_lm")

    def ask(inputs):
        with Client(server.url) as c:
            return c.infer("python_lm", inputs, outputs=outputs)
    with ThreadPoolExecutor(threads) as pool:
        answers = list(pool.map(ask, requests))
    count1, total1 = batch_sizes(server.http, "python_lm")
    assert total1 - total0 == len(requests)
    return answers, (total1 - total0) / (count1 - count0)


def test_concurrent_sequences_are_batched_and_each_gets_its_own_rows(server):
    """48 requests of 10..200 tokens from 16 threads: they share batches (packed, no padding),
    and each response holds that sequence's rows. A batch's GEMMs block by its row count, so
    its float32 sums round apart from a lone run's, and the recurrence carries the difference
    along: bounded here by 3e-5 of each output's scale (measured up to 3e-6 for logits after 200
    steps on a Xeon, 1.02e-5 for the last state on an AMD EPYC with AVX2 only)."""
    net = lm.load(LM)
    rng = np.random.default_rng(4)
    requests = [rng.integers(0, 4096, rng.integers(10, 201)).astype(np.int32) for _ in range(48)]
    answers, mean_batch = infer_concurrently(server, [lm_request(ids) for ids in requests], ["logits", "last"], 16)
    assert mean_batch > 2  # requests shared batches
    for ids, out in zip(requests, answers):
        want = lm_reference(net, ids)
        assert out["logits"].shape == (len(ids), 4096)
        for name in ("logits", "last"):
            assert_close(out[name], want[name], 3e-5, name)


def test_an_int8_server_batches_requests_that_each_equal_a_lone_int8_run():
    """`lamina serve --dtype int8`: int8 products quantize each row on its own and sum in int32,
    so a request's answer does not depend on the batch it shared; it equals net.run of the int8
    network on that sequence alone to float32 rounding (1e-5 of the scale), and differs from
    float32's."""
    s = Server(str(LM), "--dtype", "int8", "--max-delay-ms", "30")
    try:
        net, f32 = lm.quantize(lm.load(LM)), lm.load(LM)
        rng = np.random.default_rng(6)
        requests = [rng.integers(0, 4096, rng.integers(10, 80)).astype(np.int32) for _ in range(16)]
        answers, mean_batch = infer_concurrently(s, [lm_request(ids) for ids in requests], ["logits"], 8)
        assert mean_batch > 1
        for ids, out in zip(requests, answers):
            assert_close(out["logits"], lm_reference(net, ids)["logits"], 1e-5, "logits")
        assert np.abs(out["logits"] - lm_reference(f32, ids)["logits"]).max() > 1e-3
    finally:
        assert s.stop()


def test_concurrent_scoring_requests_get_their_own_likelihoods(server):
    """Scoring (ids and the tokens that follow them, the per-token negative log-likelihood
    back): 24 concurrent requests share batches and each gets its own steps' scores, which are
    -log softmax(logits)[next] of a lone run (float64 reference)."""
    net = lm.load(LM)
    rng = np.random.default_rng(5)
    texts = [rng.integers(0, 4096, rng.integers(11, 202)).astype(np.int32) for _ in range(24)]
    answers, mean_batch = infer_concurrently(server, [{"ids": t[:-1], "next": t[1:]} for t in texts], ["nll"], 12)
    assert mean_batch > 2
    for tokens, out in zip(texts, answers):
        want = lm_reference(net, tokens[:-1], tokens[1:])
        logits = want["logits"].astype(np.float64)
        top = logits.max(1)
        exact = top + np.log(np.exp(logits - top[:, None]).sum(1)) - logits[np.arange(len(logits)), tokens[1:]]
        assert list(out) == ["nll"] and out["nll"].shape == (len(tokens) - 1,)
        assert_close(want["nll"], exact, 1e-6, "nll of a lone run")
        assert_close(out["nll"], want["nll"], 1e-5, "nll")


def post(server, model, body, headers=None):
    return server.http.post(f"/v2/models/{model}/infer", content=body,
                            headers=headers or {"content-type": "application/json"})


def json_body(inputs, **extra):
    return json.dumps({"inputs": inputs, **extra}).encode()


BAD = {
    "malformed JSON": (b'{"inputs": [', 400, "not valid JSON"),
    "no inputs": (json_body([]), 400, "non-empty list 'inputs'"),
    "unknown input": (json_body([{"name": "y", "shape": [1, 4], "datatype": "FP32", "data": [0, 0, 0, 0]}]), 400,
                      "unknown input 'y'"),
    "wrong datatype": (json_body([{"name": "x", "shape": [1, 4], "datatype": "FP64", "data": [0, 0, 0, 0]}]), 400,
                       "expected datatype FP32, found FP64"),
    "unknown datatype": (json_body([{"name": "x", "shape": [1, 4], "datatype": "F32", "data": [0, 0, 0, 0]}]), 400,
                         "unknown datatype 'F32'"),
    "wrong shape": (json_body([{"name": "x", "shape": [2, 3], "datatype": "FP32", "data": [0] * 6}]), 400,
                    "expected shape [n, 4], found [2, 3]"),
    "data size": (json_body([{"name": "x", "shape": [2, 4], "datatype": "FP32", "data": [0] * 5}]), 400,
                  "needs 8 values, data holds 5"),
    "not numbers": (json_body([{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": ["a", 1, 2, 3]}]), 400,
                    "data must be numbers"),
    "NaN": (b'{"inputs": [{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [NaN, 0, 0, 0]}]}', 400,
            "must be finite"),
    "unknown output": (json_body([{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}],
                                 outputs=[{"name": "probs"}]), 400, "unknown output 'probs'"),
    "oversized": (b"{" + b" " * (1 << 20) + b"}", 413, "more than this server's limit"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_gets_the_protocol_error(server, case):
    body, status, phrase = BAD[case]
    r = post(server, "clf", body)
    assert r.status_code == status, r.text
    assert phrase in r.json()["error"]
    assert server.http.get("/v2/health/live").status_code == 200


def test_bad_binary_data(server):
    x = np.zeros((1, 4), np.float32)
    body, headers = encode_request({"x": x})
    r = post(server, "clf", body[:-3], headers)  # the tensor's bytes cut short
    assert r.status_code == 400 and "binary_data_size 16 does not fit the 13 bytes" in r.json()["error"]
    r = post(server, "clf", body, {**headers, "inference-header-content-length": "nine"})
    assert r.status_code == 400 and "must be an integer" in r.json()["error"]
    r = post(server, "clf", body + b"xx", headers)
    assert r.status_code == 400 and "2 bytes after the inputs" in r.json()["error"]


def test_a_bad_id_fails_alone_in_its_batch(server):
    """Out-of-range ids are found by the network inside the batch: the batch runs again one
    request at a time, so only that request fails."""
    net = lm.load(LM)
    good = [np.arange(i, i + 20, dtype=np.int32) for i in range(3)]
    bad = np.array([1, 2, 4096 + 7], np.int32)
    count0, total0 = batch_sizes(server.http, "python_lm")

    def ask(ids):
        with Client(server.url) as c:
            try:
                return c.infer("python_lm", lm_request(ids), outputs=["last"])
            except ServerError as e:
                return e
    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, good + [bad]))
    assert isinstance(answers[3], ServerError) and answers[3].status == 400
    assert "4103" in answers[3].message and "4096" in answers[3].message
    for ids, out in zip(good, answers[:3]):
        assert_close(out["last"], lm_reference(net, ids)["last"], 1e-5, "last")
    count1, _ = batch_sizes(server.http, "python_lm")
    assert count1 - count0 < 4  # the four went in together
    r = post(server, "python_lm", json_body([{"name": "h0", "shape": [1, 1, 256], "datatype": "FP32",
                                              "data": [0] * 256}]))
    assert r.status_code == 400 and "no output can be computed from inputs ['h0']" in r.json()["error"]
    r = post(server, "python_lm", json_body([{"name": "h0", "shape": [1, 1, 256], "datatype": "FP32",
                                              "data": [0] * 256}], outputs=[{"name": "last"}]))
    assert r.status_code == 400 and "missing input 'ids' (needed for output(s) last)" in r.json()["error"]


def test_initial_states_may_be_left_out(server):
    """h0 and c0 feed only the LSTM's initial state: a request without them gets zeros (as
    PyTorch's LSTM does), here over plain JSON as curl would send it."""
    ids = [12, 7, 99, 5]
    r = post(server, "python_lm", json_body([{"name": "ids", "shape": [4], "datatype": "INT64", "data": ids}],
                                            outputs=[{"name": "last"}]))
    assert r.status_code == 200, r.text
    (out,) = r.json()["outputs"]
    assert out["name"] == "last" and out["shape"] == [1, 1, 256]
    want = lm_reference(lm.load(LM), np.array(ids, np.int32))["last"]
    assert_close(np.array(out["data"], np.float32).reshape(1, 1, 256), want, 1e-6, "last")


def test_a_request_past_its_deadline_gets_504(models):
    s = Server(f"clf={models['clf']}", "--max-delay-ms", "3000", "--timeout-ms", "300")
    try:
        start = time.monotonic()
        r = post(s, "clf", json_body([{"name": "x", "shape": [1, 4], "datatype": "FP32", "data": [0] * 4}]))
        assert r.status_code == 504 and "deadline of 0.3 s" in r.json()["error"]
        assert time.monotonic() - start < 2.5
    finally:
        assert s.stop()


def test_sigterm_under_load_loses_no_accepted_request(models):
    """16 requests wait in a batch that closes after 3 s; SIGTERM arrives once all 16 are
    queued (accepted): each is still answered, correctly, and the server then exits cleanly."""
    s = Server(f"clf={models['clf']}", "--max-delay-ms", "3000", "--max-batch-size", "64")
    clf = lm.load(models["clf"])
    xs = [np.random.default_rng(i).standard_normal((2, 4)).astype(np.float32) for i in range(16)]
    answers = [None] * 16

    def ask(i):
        with Client(s.url) as c:
            answers[i] = c.infer("clf", {"x": xs[i]}, outputs=["logits"])
    threads = [threading.Thread(target=ask, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while 'lamina_queued_requests{model="clf"} 16.0' not in s.http.get("/metrics").text:
        assert time.monotonic() < deadline, "the 16 requests never all queued"
        time.sleep(0.02)
    s.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(30)
    assert s.stop()
    for x, out in zip(xs, answers):
        assert out is not None
        assert_close(out["logits"], clf.run({"x": x})["logits"], 1e-6, "logits")


def test_per_model_batching(models):
    s = Server(f"clf={models['clf']}", str(DENOISER), "--batching", "clf=3:1.5", "--max-batch-size", "8")
    try:
        assert s.url
        meta = s.http.get("/v2/models/clf").json()["parameters"]
        assert meta["max_batch_size"] == 3 and s.http.get("/v2/models/denoise3d").json()["parameters"][
            "max_batch_size"] == 8
    finally:
        assert s.stop()


def test_serve_command_errors(tmp_path, capsys):
    from lamina.cli import main
    assert main(["serve", str(tmp_path / "missing.lamina")]) == 2
    assert "missing.lamina" in capsys.readouterr().err
    assert main(["serve", str(LM), f"python_lm={DENOISER}"]) == 2
    assert "two models are named 'python_lm'" in capsys.readouterr().err
    assert main(["serve", str(LM), "--batching", "lm=4"]) == 2
    assert "--batching lm=4: no model named 'lm'; models: python_lm" in capsys.readouterr().err
    assert main(["serve", str(LM), "--batching", "python_lm=x"]) == 2
    assert "expected NAME=SIZE[:DELAY_MS]" in capsys.readouterr().err
    from lamina.serve import model_name
    assert model_name("models/python_lm/model.lamina") == "python_lm" and model_name("a/b/net.onnx") == "net"


def test_an_encoder_server_packs_requests_and_answers_each_its_pooled_embedding(tmp_path):
    """A transformer encoder (embeddings, 2 layers, mean pooling) behind `lamina serve`: 24
    concurrent requests of 3..60 tokens share batches, packed without padding (attention stays
    within each request), and each gets its own pooled embedding, a lone net.run's to 1e-5 of
    the scale."""
    lm.manual_seed(21)
    net = lm.Network()
    ids = net.input("ids", dtype="int32", sequence=True)
    h = lm.layers.LayerNorm(32)(lm.layers.PositionalEmbedding(64, 32)(lm.layers.Embedding(100, 32)(ids)))
    layer = lm.layers.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu")
    net.outputs(pooled=lm.layers.SequencePool("average")(lm.layers.TransformerEncoder(layer, 2, name="enc")(h)))
    lm.save(net, tmp_path / "encoder.lamina")
    s = Server(f"encoder={tmp_path / 'encoder.lamina'}", "--max-delay-ms", "30")
    try:
        rng = np.random.default_rng(22)
        requests = [rng.integers(0, 100, rng.integers(3, 61)).astype(np.int32) for _ in range(24)]
        count0, total0 = batch_sizes(s.http, "encoder")

        def ask(steps):
            with Client(s.url) as c:
                return c.infer("encoder", {"ids": steps}, outputs=["pooled"])["pooled"]
        with ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(ask, requests))
        count1, total1 = batch_sizes(s.http, "encoder")
        assert total1 - total0 == len(requests) and (total1 - total0) / (count1 - count0) > 1
        for steps, got in zip(requests, answers):
            want = net.run({"ids": lm.Sequences(steps, np.array([0, len(steps)], np.int32))})["pooled"]
            assert_close(got, want, 1e-5, "pooled")
    finally:
        assert s.stop()


def test_a_model_of_any_image_size_is_served_at_each_requests_size(tmp_path):
    """An ONNX segmentation model exported with dynamic height and width behind `lamina serve`:
    its metadata says -1 on those axes; concurrent requests of three sizes are each answered at
    their own size (requests of one size batched together), as ONNX Runtime answers them; a wrong
    channel count is a 400."""
    torch = pytest.importorskip("torch")
    ort = pytest.importorskip("onnxruntime")
    from test_onnx_models import build
    from test_sample_shapes import export
    blob = export(build("segmentation"), torch.randn(2, 3, 32, 32), (2, 3), dynamo=False)
    (tmp_path / "seg.onnx").write_bytes(blob)
    session = ort.InferenceSession(blob, providers=["CPUExecutionProvider"])
    output = session.get_outputs()[0].name
    s = Server(f"seg={tmp_path / 'seg.onnx'}", "--max-delay-ms", "30")
    try:
        meta = s.http.get("/v2/models/seg").json()
        assert meta["inputs"][0]["shape"] == [-1, 3, -1, -1]
        rng = np.random.default_rng(23)
        sizes = [(20, 28), (33, 17), (20, 28), (64, 48), (33, 17), (20, 28)] * 2
        requests = [rng.standard_normal((1, 3) + size).astype(np.float32) for size in sizes]
        count0, total0 = batch_sizes(s.http, "seg")

        def ask(x):
            with Client(s.url) as c:
                return c.infer("seg", {"x": x}, outputs=[output])[output]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(ask, requests))
        count1, total1 = batch_sizes(s.http, "seg")
        assert total1 - total0 == len(requests)
        for x, got in zip(requests, answers):
            assert_close(got, session.run(None, {"x": x})[0], 1e-4, output)
        body, headers = encode_request({"x": np.zeros((1, 4, 8, 8), np.float32)})
        bad = s.http.post("/v2/models/seg/infer", content=body, headers=headers)
        assert bad.status_code == 400 and "expected shape [n, 3, -1, -1]" in bad.json()["error"]
    finally:
        assert s.stop()
