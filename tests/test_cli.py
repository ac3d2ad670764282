"""The `lamina` command and the training loop: infer, train (checkpoints, log, loss curve,
resume, Ctrl-C), inspect, devices, clear errors; a small text model end to end."""
import json
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import lamina as lm
from lamina.cli import main
from lamina.layers import Linear, SoftmaxCrossEntropy
from lamina.text import PythonTokenizer
from lamina.zoo import language

SOURCE = '''import os


def walk(top, files=None):
    """Yield every file below top."""
    files = [] if files is None else files
    for name in sorted(os.listdir(top)):
        path = os.path.join(top, name)
        if os.path.isdir(path):
            walk(path, files)
        else:
            files.append(path)
    return files


class Counter:
    def __init__(self):
        self.count = 0

    def add(self, n=1):
        self.count += n
        return self.count
''' * 3


def classifier(path):
    lm.manual_seed(0)
    net = lm.Network()
    x, y = net.input("x", 4), net.input("y", dtype="int32")
    logits = Linear(8, 3, name="head")(Linear(4, 8, activation="tanh", name="hidden")(x))
    net.outputs(loss=SoftmaxCrossEntropy(name="xent")(logits, y), logits=logits)
    lm.save(net, path)
    return net


def data(path, n=96):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    np.savez(path, x=x, y=(x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 1).astype(np.int32))


def test_infer_npz(tmp_path, capsys):
    net = classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "-o", str(tmp_path / "out.npz")]) == 0
    out = np.load(tmp_path / "out.npz")
    x = np.load(tmp_path / "d.npz")["x"]
    np.testing.assert_array_equal(out["logits"], net.run({"x": x})["logits"])
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz")]) == 0
    assert "logits: float32 [96, 3]" in capsys.readouterr().out


def test_train_checkpoints_logs_and_resumes(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    run = tmp_path / "run"
    args = ["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--epochs", "3", "--batch-size", "16",
            "--lr", "0.05", "--checkpoint-dir", str(run), "--quiet"]
    # straight: 3 epochs of 6 batches
    assert main(args + ["--out", str(tmp_path / "straight.lamina")]) == 0
    log = [json.loads(line) for line in open(run / "log.jsonl")]
    assert len(log) == 18 and log[-1]["loss"] < log[0]["loss"]
    assert (run / "loss.png").stat().st_size > 1000
    # interrupted after 7 steps, resumed to the end: the same parameters
    run2 = tmp_path / "run2"
    args2 = [a if a != str(run) else str(run2) for a in args]
    assert main(args2 + ["--max-steps", "7", "--out", str(tmp_path / "part.lamina")]) == 0
    ck = lm.load_checkpoint(run2 / "checkpoint.lamina")
    assert (ck.fields["epoch"], ck.fields["batch"], ck.step_count) == (1, 1, 7)
    assert main(args2 + ["--resume", "--out", str(tmp_path / "resumed.lamina")]) == 0
    a, b = lm.load(tmp_path / "straight.lamina"), lm.load(tmp_path / "resumed.lamina")
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.value, q.value, err_msg=name)
    assert "resuming from" in capsys.readouterr().out


def test_ctrl_c_writes_a_checkpoint(tmp_path):
    classifier(tmp_path / "m.lamina")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 4)).astype(np.float32)
    np.savez(tmp_path / "big.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lamina.cli", "train", str(tmp_path / "m.lamina"),
                             str(tmp_path / "big.npz"), "--epochs", "1000", "--batch-size", "8",
                             "--checkpoint-dir", str(run), "--quiet"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (run / "log.jsonl").exists() or (run / "log.jsonl").stat().st_size < 2000:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "interrupted: checkpoint written" in out + err
    ck = lm.load_checkpoint(run / "checkpoint.lamina")
    per_epoch = 4000 // 8  # the position in the data is where the step count says
    assert ck.step_count > 0 and ck.fields["epoch"] * per_epoch + ck.fields["batch"] == ck.step_count


def test_inspect_and_devices(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    assert main(["inspect", str(tmp_path / "m.lamina")]) == 0
    out = capsys.readouterr().out
    assert "format lamina version 1" in out and "hidden" in out and "67 parameters" in out
    assert main(["devices", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu: ") and "1 threads" in out and "opencl" in out


def test_errors_are_one_clear_line(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    assert main(["inspect", str(tmp_path / "missing.lamina")]) == 2
    assert "missing.lamina: no such model file" in capsys.readouterr().err
    (tmp_path / "junk.lamina").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    assert main(["inspect", str(tmp_path / "junk.lamina")]) == 2
    assert "junk.lamina:" in capsys.readouterr().err
    np.savez(tmp_path / "wrong.npz", z=np.zeros(3))
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "wrong.npz")]) == 2
    assert "no array is named after an input" in capsys.readouterr().err
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "wrong.npz"), "--device", "gpu"]) == 2
    assert "--device must be cpu or opencl[:N], found 'gpu'" in capsys.readouterr().err
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "wrong.npz"), "--device", "opencl:99"]) == 2
    assert "--device opencl:99" in capsys.readouterr().err
    assert main(["train", str(tmp_path / "m.lamina"), str(tmp_path / "wrong.npz"), "--resume",
                 "--checkpoint-dir", str(tmp_path / "none")]) == 2
    assert "no checkpoint to resume from" in capsys.readouterr().err


def test_text_model_end_to_end(tmp_path, capsys):
    """A tiny language model: built, trained by the command on a source file, scored and
    continued; perplexity falls with training."""
    lm.manual_seed(0)
    tok = PythonTokenizer.build([SOURCE], 64)
    net = language.build(len(tok), embedding_dim=8, hidden_size=16)
    net.assets["vocabulary"] = tok.vocabulary
    lm.save(net, tmp_path / "lm.lamina")
    (tmp_path / "code.py").write_text(SOURCE)
    chunks = language.chunk(tok.encode(SOURCE), 48)
    before = language.perplexity(net, chunks)
    assert main(["train", str(tmp_path / "lm.lamina"), str(tmp_path / "code.py"), "--epochs", "40", "--lr", "0.02",
                 "--batch-size", "4", "--checkpoint-dir", str(tmp_path / "run"), "--quiet"]) == 0
    trained = lm.load(tmp_path / "lm.lamina")
    after = language.perplexity(trained, chunks)
    assert after < 0.5 * before, (before, after)
    assert main(["infer", str(tmp_path / "lm.lamina"), "--text", "class Counter:", "--tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert "perplexity of the input" in out and "class Counter:" in out
    source, seconds = language.continue_code(trained, "def walk(", tokens=5, top_k=1)
    assert source.startswith("def walk(") and seconds > 0


def test_train_from_a_description(tmp_path):
    from lamina.io import save_description
    net = classifier(tmp_path / "m.lamina")
    save_description(net, tmp_path / "net.json")
    data(tmp_path / "d.npz")
    assert main(["train", str(tmp_path / "net.json"), str(tmp_path / "d.npz"), "--epochs", "2",
                 "--checkpoint-dir", str(tmp_path / "run"), "--quiet"]) == 0
    trained = lm.load(tmp_path / "net.lamina")
    assert [n for n, _ in trained.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert not np.array_equal(trained.layer("head").weight.value, net.layer("head").weight.value)



def test_infer_and_train_on_opencl(tmp_path, capsys):
    from lamina.backends.opencl import devices
    if not devices():
        pytest.skip("no OpenCL device")
    net = classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    assert main(["infer", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "-o", str(tmp_path / "out.npz"),
                 "--device", "opencl:0"]) == 0
    x = np.load(tmp_path / "d.npz")["x"]
    np.testing.assert_allclose(np.load(tmp_path / "out.npz")["logits"], net.run({"x": x})["logits"], rtol=1e-4, atol=1e-6)
    args = ["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--epochs", "2", "--batch-size", "16",
            "--checkpoint-dir", str(tmp_path / "run"), "--quiet", "--device", "opencl:0"]
    assert main(args + ["--max-steps", "3", "--out", str(tmp_path / "a.lamina")]) == 0
    assert main(args + ["--resume", "--out", str(tmp_path / "b.lamina")]) == 0
    assert main(["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--epochs", "2", "--batch-size", "16",
                 "--checkpoint-dir", str(tmp_path / "cpu"), "--quiet", "--out", str(tmp_path / "c.lamina")]) == 0
    for (name, p), (_, q) in zip(lm.load(tmp_path / "b.lamina").named_parameters(),
                                 lm.load(tmp_path / "c.lamina").named_parameters()):
        np.testing.assert_allclose(p.value, q.value, rtol=1e-4, atol=1e-5, err_msg=name)
