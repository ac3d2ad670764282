"""`lamina serve` driven by real protocol clients nobody on the project wrote: tritonclient's
HTTP client (sync and asyncio). Every call a client makes first (health, metadata, versions,
configuration, repository index, statistics), inference in JSON and binary, compressed request
bodies, classification, and errors read as the protocol's JSON; every value equals net.run."""
import asyncio
import importlib.util

import numpy as np
import pytest

import lamina as lm

from test_serve import LM, Server, assert_close, lm_reference

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    from test_cli import classifier
    folder = tmp_path_factory.mktemp("models")
    classifier(folder / "clf.lamina")
    s = Server(f"clf={folder / 'clf.lamina'}", str(LM), "--max-delay-ms", "2", "--grpc-port", "0")
    yield s, lm.load(folder / "clf.lamina")
    assert s.stop()


def client_of(server):
    return httpclient.InferenceServerClient(url=server.url.removeprefix("http://"))


def test_health_metadata_versions_configuration_index_and_statistics(served):
    server, _ = served
    c = client_of(server)
    assert c.is_server_live() and c.is_server_ready()
    meta = c.get_server_metadata()
    assert meta["name"] == "lamina" and "classification" in meta["extensions"] and "statistics" in meta["extensions"]
    for version in ("", "1"):
        assert c.is_model_ready("clf", version)
        assert c.get_model_metadata("clf", version)["inputs"][0]["name"] == "x"
        config = c.get_model_config("clf", version)
        assert config["max_batch_size"] == 32 and config["input"] == [
            {"name": "x", "data_type": "TYPE_FP32", "dims": [4], "optional": False}]
        assert {o["name"] for o in config["output"]} == {"logits"}
    assert not c.is_model_ready("clf", "2")
    index = c.get_model_repository_index()
    assert [(m["name"], m["version"], m["state"]) for m in index] == [("clf", "1", "READY"), ("python_lm", "1", "READY")]
    x = np.ones((3, 4), np.float32)
    before = c.get_inference_statistics("clf")["model_stats"][0]
    inputs = [httpclient.InferInput("x", [3, 4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    c.infer("clf", inputs)
    after = c.get_inference_statistics("clf", "1")["model_stats"][0]
    assert after["name"] == "clf" and after["inference_count"] == before["inference_count"] + 1
    assert after["inference_stats"]["success"]["count"] == before["inference_stats"]["success"]["count"] + 1
    assert after["inference_stats"]["success"]["ns"] > before["inference_stats"]["success"]["ns"]
    assert sum(b["compute_infer"]["count"] for b in after["batch_stats"]) == after["execution_count"] >= 1
    every = c.get_inference_statistics()["model_stats"]
    assert [m["name"] for m in every] == ["clf", "python_lm"]
    c.close()


@pytest.mark.parametrize("binary", [True, False])
@pytest.mark.parametrize("compression", [None, "gzip", "deflate"])
def test_inference_with_versions_binary_and_compressed_bodies_equals_net_run(served, binary, compression):
    server, clf = served
    c = client_of(server)
    x = np.random.default_rng(3).standard_normal((5, 4)).astype(np.float32)
    inputs = [httpclient.InferInput("x", list(x.shape), "FP32")]
    inputs[0].set_data_from_numpy(x, binary_data=binary)
    outputs = [httpclient.InferRequestedOutput("logits", binary_data=binary)]
    result = c.infer("clf", inputs, outputs=outputs, model_version="1", request_compression_algorithm=compression,
                     response_compression_algorithm=compression)
    assert_close(result.as_numpy("logits"), clf.run({"x": x})["logits"], 1e-6, "logits")
    ids = np.random.default_rng(4).integers(0, 4096, 21).astype(np.int32)
    seq = [httpclient.InferInput("ids", [21], "INT32")]
    seq[0].set_data_from_numpy(ids, binary_data=binary)
    result = c.infer("python_lm", seq, outputs=[httpclient.InferRequestedOutput("last", binary_data=binary)],
                     request_compression_algorithm=compression)
    assert_close(result.as_numpy("last"), lm_reference(lm.load(LM), ids)["last"], 1e-6, "last")
    c.close()


def test_classification_gives_each_rows_best_classes(served):
    server, clf = served
    c = client_of(server)
    x = np.random.default_rng(5).standard_normal((4, 4)).astype(np.float32)
    inputs = [httpclient.InferInput("x", [4, 4], "FP32")]
    inputs[0].set_data_from_numpy(x)
    for binary in (True, False):
        result = c.infer("clf", inputs, outputs=[httpclient.InferRequestedOutput("logits", binary_data=binary,
                                                                                  class_count=2)])
        got = result.as_numpy("logits")
        assert got.shape == (4, 2)
        logits = clf.run({"x": x})["logits"]
        for row, want in zip(got, logits):
            parsed = [(entry.decode() if isinstance(entry, bytes) else entry).split(":") for entry in row]
            assert [int(i) for _, i in parsed] == list(np.argsort(-want)[:2])
            np.testing.assert_allclose([float(v) for v, _ in parsed], np.sort(want)[::-1][:2], rtol=1e-5, atol=1e-6)
    c.close()


def test_errors_are_the_protocols_json_for_the_client_to_read(served):
    server, _ = served
    c = client_of(server)
    with pytest.raises(InferenceServerException, match="unknown model 'nope'"):
        c.get_model_metadata("nope")
    with pytest.raises(InferenceServerException, match="model 'clf' has no version '7'"):
        c.get_model_config("clf", "7")
    inputs = [httpclient.InferInput("x", [1, 3], "FP32")]
    inputs[0].set_data_from_numpy(np.zeros((1, 3), np.float32))
    with pytest.raises(InferenceServerException, match=r"expected shape \[n, 4\], found \[1, 3\]"):
        c.infer("clf", inputs)
    r = server.http.get("/v2/no/such/route")
    assert r.status_code == 404 and r.json() == {"error": "no route /v2/no/such/route"}
    r = server.http.delete("/v2/models/clf/infer")
    assert r.status_code == 405 and "DELETE is not allowed" in r.json()["error"]
    c.close()


def test_the_asyncio_client(served):
    import tritonclient.http.aio as aioclient
    server, clf = served

    async def ask():
        c = aioclient.InferenceServerClient(url=server.url.removeprefix("http://"))
        try:
            assert await c.is_model_ready("clf", "1")
            xs = [np.random.default_rng(i).standard_normal((i + 1, 4)).astype(np.float32) for i in range(6)]

            async def one(x):
                inputs = [aioclient.InferInput("x", list(x.shape), "FP32")]
                inputs[0].set_data_from_numpy(x)
                return (await c.infer("clf", inputs, model_version="1")).as_numpy("logits")
            return xs, await asyncio.gather(*(one(x) for x in xs))
        finally:
            await c.close()
    xs, answers = asyncio.run(ask())
    for x, got in zip(xs, answers):
        assert_close(got, clf.run({"x": x})["logits"], 1e-6, "logits")


def test_kserves_rest_client(served):
    """KServe's InferenceRESTClient (protocol v2): health, readiness, and inference in JSON and
    with binary tensors, equal to net.run."""
    pytest.importorskip("kserve")
    from kserve import InferenceRESTClient, RESTConfig
    from kserve.protocol.infer_type import InferInput, InferRequest, RequestedOutput
    server, clf = served
    x = np.random.default_rng(6).standard_normal((3, 4)).astype(np.float32)

    async def ask():
        client = InferenceRESTClient(RESTConfig(protocol="v2", retries=1))
        try:
            assert await client.is_server_live(server.url) and await client.is_server_ready(server.url)
            assert await client.is_model_ready(server.url, "clf")
            answers = []
            for binary in (False, True):
                tensor = InferInput("x", list(x.shape), "FP32")
                tensor.set_data_from_numpy(x, binary_data=binary)
                request = InferRequest("clf", [tensor], request_outputs=[
                    RequestedOutput("logits", parameters={"binary_data": binary})])
                response = await client.infer(server.url, request, model_name="clf")
                answers.append(response.outputs[0].as_numpy())
            return answers
        finally:
            await client.close()
    for got in asyncio.run(ask()):
        assert_close(got.reshape(3, 3), clf.run({"x": x})["logits"], 1e-6, "logits")


# ---------------------------------------------------------------------------- gRPC


TRITON_GRPC = """
import sys
import numpy as np
import pytest
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException

c = grpcclient.InferenceServerClient(sys.argv[1])
assert c.is_server_live() and c.is_server_ready()
assert c.is_model_ready("clf") and c.is_model_ready("clf", "1") and not c.is_model_ready("clf", "2")
assert [t.name for t in c.get_model_metadata("python_lm").inputs] == ["ids", "h0", "c0", "next"]
assert list(c.get_server_metadata().extensions) == ["classification"]
x = np.load(sys.argv[2])
inputs = [grpcclient.InferInput("x", list(x.shape), "FP32")]
inputs[0].set_data_from_numpy(x)
result = c.infer("clf", inputs, model_version="1", request_id="r7")
assert result.get_response().id == "r7"
best = c.infer("clf", inputs, outputs=[grpcclient.InferRequestedOutput("logits", class_count=1)]).as_numpy("logits")
padded = np.load(sys.argv[3])
ids = [grpcclient.InferInput("ids", list(padded.shape), "INT32")]
ids[0].set_data_from_numpy(padded)
last = c.infer("python_lm", ids, outputs=[grpcclient.InferRequestedOutput("last")], parameters={"sequence_lengths": sys.argv[4]})
bad = [grpcclient.InferInput("x", [1, 3], "FP32")]
bad[0].set_data_from_numpy(np.zeros((1, 3), np.float32))
with pytest.raises(InferenceServerException, match=r"INVALID_ARGUMENT.*expected shape \\[n, 4\\], found \\[1, 3\\]"):
    c.infer("clf", bad)
with pytest.raises(InferenceServerException, match="NOT_FOUND.*unknown model 'nope'"):
    c.get_model_metadata("nope")
np.savez(sys.argv[5], logits=result.as_numpy("logits"), best=np.array([int(e.decode().split(":")[1]) for e in best[:, 0]]),
         last=last.as_numpy("last"))
c.close()
"""


def run_client(script_text, tmp_path, *args):
    """A protocol client's script run in a process of its own: Triton's and KServe's generated
    gRPC modules declare the same protobuf names, so one process can import only one of them."""
    import subprocess
    import sys
    script = tmp_path / "client.py"
    script.write_text(script_text)
    proc = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_tritons_grpc_client(served, tmp_path):
    """tritonclient's gRPC client against --grpc-port: health, readiness by version, metadata,
    inference with raw tensors (with a request id), several sequences padded with their lengths
    in a string parameter, classification, and errors as gRPC status codes with the message;
    values equal net.run."""
    assert importlib.util.find_spec("tritonclient.grpc"), "make test installs tritonclient[grpc]"
    server, clf = served
    x = np.random.default_rng(7).standard_normal((3, 4)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    seqs = [np.random.default_rng(i).integers(0, 4096, n).astype(np.int32) for i, n in enumerate((6, 2, 4))]
    padded, lengths = lm.Sequences.from_list(seqs).to_padded()
    np.save(tmp_path / "ids.npy", padded)
    run_client(TRITON_GRPC, tmp_path, server.grpc, tmp_path / "x.npy", tmp_path / "ids.npy",
               ",".join(map(str, lengths)), tmp_path / "out.npz")
    out = np.load(tmp_path / "out.npz")
    logits = clf.run({"x": x})["logits"]
    assert_close(out["logits"], logits, 1e-6, "logits")
    assert list(out["best"]) == list(logits.argmax(1))
    net = lm.load(LM)
    for i, steps in enumerate(seqs):
        assert_close(out["last"][i], lm_reference(net, steps)["last"][0], 1e-5, "last")


KSERVE_GRPC = """
import asyncio, sys
import numpy as np
from kserve import InferenceGRPCClient
from kserve.protocol.infer_type import InferInput, InferRequest

async def main(url):
    client = InferenceGRPCClient(url)
    assert await client.is_server_ready() and await client.is_model_ready("clf")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    tensor = InferInput("x", [2, 4], "FP32")
    tensor.set_data_from_numpy(x, binary_data=False)
    response = await client.infer(InferRequest("clf", [tensor]))
    np.save(sys.argv[2], response.outputs[0].as_numpy())
    await client.close()

asyncio.run(main(sys.argv[1]))
"""


def test_kserves_grpc_client(served, tmp_path):
    """KServe's InferenceGRPCClient: readiness and inference with its own tensor form."""
    assert importlib.util.find_spec("kserve"), "make test installs kserve"
    server, clf = served
    run_client(KSERVE_GRPC, tmp_path, server.grpc, tmp_path / "logits.npy")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) / 8
    assert_close(np.load(tmp_path / "logits.npy").reshape(2, 3), clf.run({"x": x})["logits"], 1e-6, "logits")
