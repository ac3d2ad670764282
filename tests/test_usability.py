"""What users bring from other tools works, or says lamina's form: ONNX files through lm.load,
ONNX Runtime's run(None, feeds) and get_inputs(), PyTorch's net(x) and eval(); files of another
kind named for what they are; the version; a missing extra named with its pip line."""
import subprocess
import sys

import numpy as np
import pytest

import lamina as lm
from lamina.cli import main


def test_lm_load_takes_onnx_files_by_suffix_and_by_content(tmp_path):
    torch = pytest.importorskip("torch")
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh()).eval()
    torch.onnx.export(model, (torch.randn(2, 4),), str(tmp_path / "m.onnx"), dynamo=False, input_names=["x"],
                      output_names=["y"], dynamic_axes={"x": {0: "n"}, "y": {0: "n"}})
    (tmp_path / "m.model").write_bytes((tmp_path / "m.onnx").read_bytes())
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    want = model(torch.from_numpy(x)).detach().numpy()
    for name in ("m.onnx", "m.model"):
        np.testing.assert_allclose(lm.load(tmp_path / name).run({"x": x})["y"], want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("content, kind", [
    (b"# notes\nnot a model\n", "a text file"),
    (b"import os\nprint(os.getcwd())\n", "a text file"),
    (b"PK\x03\x04" + bytes(40), "a zip archive"),
    (b"\x80\x04\x95" + bytes(20), "a Python pickle"),
    (b'{"format": "lamina"}', "JSON text"),
])
def test_a_file_of_another_kind_is_named_for_what_it_is(tmp_path, content, kind):
    path = tmp_path / "thing.bin"
    path.write_bytes(content)
    with pytest.raises(lm.ModelFileError, match=f"thing.bin: not a model file: it looks like {kind}"):
        lm.load(path)


def test_onnx_runtimes_and_pytorchs_habits(tmp_path):
    net = lm.load(lm.models.path("denoise3d"))
    x = np.random.default_rng(1).standard_normal((2, 1, 24, 24, 24)).astype(np.float32)
    want = net.run({"noisy": x})["denoised"]
    (got,) = net.run(None, {"noisy": x})[:1]  # ONNX Runtime: every output its inputs compute, as a list
    np.testing.assert_array_equal(got, want)
    assert len(net.run(["denoised"], {"noisy": x})) == 1
    inputs = net.get_inputs()
    assert [(i.name, i.type, i.shape) for i in inputs] == [("noisy", "tensor(float)", ["N", 1, 24, 24, 24]),
                                                          ("clean", "tensor(float)", ["N", 1, 24, 24, 24])]
    assert [o.name for o in net.get_outputs()] == ["denoised", "loss"]
    assert net.eval() is net
    np.testing.assert_array_equal(net(x), want)  # PyTorch: model(x), the one output computed
    with pytest.raises(lm.GraphError, match=r"net.train_step\(feeds, optimizer\)"):
        net.train()
    with pytest.raises(lm.InputError, match=r"run takes a dict of input name -> array \(run\(\{'noisy': x\}\)\)"):
        net.run(x)
    with pytest.raises(lm.InputError, match="takes 2 input"):
        net(x, x, x)
    lm_net = lm.load(lm.models.path("python_lm"))
    assert [i.shape for i in lm_net.get_inputs()][:1] == [["N", "T"]]


def test_version_and_missing_extras_are_one_line(monkeypatch, capsys):
    out = subprocess.run([sys.executable, "-m", "lamina.cli", "--version"], capture_output=True, text=True)
    assert out.stdout.strip() == f"lamina {lm.__version__}"
    import importlib
    real = importlib.import_module

    def without_uvicorn(name, *args):
        if name.split(".")[0] in ("uvicorn", "aiohttp"):
            raise ModuleNotFoundError(f"No module named '{name}'")
        return real(name, *args)
    monkeypatch.setattr(importlib, "import_module", without_uvicorn)
    assert main(["serve", "denoise3d"]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0
    assert "needs the package 'uvicorn', which is not installed: pip install 'lamina[serve]'" in err
    from lamina.extras import MissingExtra, require
    with pytest.raises(MissingExtra, match=r"the benchmarks' peers .* pip install 'lamina\[bench\]'"):
        require("aiohttp", "bench")


def test_shipped_models_by_name():
    assert lm.models.names() == ["python_lm", "denoise3d", "line_kind"]
    assert lm.models.path("python_lm").name == "model.lamina" and lm.models.path("python_lm").exists()
    with pytest.raises(KeyError, match="no shipped model named 'gpt'; lamina ships python_lm, denoise3d"):
        lm.models.path("gpt")


def test_the_cpu_is_described_from_proc_cpuinfo_and_recorded_by_the_bench(tmp_path):
    import json
    from pathlib import Path

    from lamina import processor as cpu
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    found = cpu.instruction_sets()
    assert found == [name for name in cpu.INSTRUCTION_SETS if name in flags]  # in the module's order
    assert cpu.model_name() and cpu.vendor() != ""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from bench.harness import write_json
    write_json(tmp_path / "r.json", [], {2: 123.0})
    written = json.loads((tmp_path / "r.json").read_text())
    assert written["cpu"] == json.loads(json.dumps(cpu.describe())) and written["peak_gflops"] == {"2": 123.0}


def test_the_public_exceptions_live_in_lamina_errors_and_at_the_top_level():
    """One module holds every exception lamina raises to its users; each is also lamina.<Name>,
    and subclasses what it always did (a ModelFileError is a ValueError, and so on)."""
    import importlib
    import inspect
    import pkgutil

    from lamina import errors
    internal = {"lamina.cli.CommandError", "lamina.io.onnx.registry.Refused"}  # caught inside lamina
    stray = []
    for info in pkgutil.walk_packages(lm.__path__, "lamina."):
        if info.name.startswith(("lamina.serve.grpc.inference_pb2", "lamina.backends.opencl")):
            continue  # generated code; the OpenCL backend needs pyopencl (checked below)
        module = importlib.import_module(info.name)
        for name, cls in vars(module).items():
            if (inspect.isclass(cls) and issubclass(cls, BaseException) and cls.__module__ == info.name
                    and f"{info.name}.{name}" not in internal and info.name != "lamina.errors"):
                stray.append(f"{info.name}.{name}")
    assert not stray, stray
    for name in errors.PUBLIC:
        assert getattr(lm, name) is getattr(errors, name)
    assert issubclass(lm.UnsupportedModelError, lm.ModelFileError) and issubclass(lm.ModelFileError, ValueError)
    assert issubclass(lm.OpenCLError, RuntimeError) and issubclass(lm.MissingExtra, ImportError)
    assert lm.OpenCLBackend.__name__ == "OpenCLBackend" and "OpenCLBackend" in lm.__all__
