"""The `lamina` command and the training loop: infer, train (checkpoints, log, loss curve,
resume, Ctrl-C), inspect, devices, clear errors; a small text model end to end."""
import json
import os
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

from conftest import NO_OPENCL, OPENCL_DEVICES

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


@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted: checkpoint written"),
                                                   (signal.SIGTERM, 143, "interrupted by SIGTERM: checkpoint written")])
def test_ctrl_c_and_sigterm_write_a_checkpoint(tmp_path, signum, status, said):
    """Ctrl-C, and SIGTERM (what kill and job schedulers send), stop training between steps with
    a checkpoint whose position and step count are where the log ends."""
    proc, run = start_training(tmp_path)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == status, err
    assert said in out + err
    ck = lm.load_checkpoint(run / "checkpoint.lamina")
    steps = len((run / "log.jsonl").read_text().splitlines())
    per_epoch = 4000 // 8  # the position in the data is where the step count says
    assert ck.step_count == steps > 0 and ck.fields["epoch"] * per_epoch + ck.fields["batch"] == steps


def test_inspect_and_devices(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    assert main(["inspect", str(tmp_path / "m.lamina")]) == 0
    out = capsys.readouterr().out
    assert "format lamina version 2" in out and "hidden" in out and "67 parameters" in out
    assert main(["devices", "--threads", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("cpu: ") and out[0].endswith(", 1 threads")
    from lamina import processor as cpu
    assert out[1] == f"     instruction sets: {' '.join(cpu.instruction_sets()) or 'unknown'}"
    from lamina.backends.opencl import devices
    listed = [line for line in out if line.startswith("opencl:")]
    assert len(listed) == len(devices()) >= len(OPENCL_DEVICES)
    for n, dev in enumerate(devices()):
        assert listed[n].startswith(f"opencl:{n}: {dev.name.strip()} (")


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
    trained = lm.load(tmp_path / "run" / "model.lamina")  # the input model is never overwritten
    after = language.perplexity(trained, chunks)
    assert after < 0.5 * before, (before, after)
    assert main(["infer", str(tmp_path / "run" / "model.lamina"), "--text", "class Counter:", "--tokens", "12"]) == 0
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
    trained = lm.load(tmp_path / "run" / "model.lamina")
    assert [n for n, _ in trained.named_parameters()] == [n for n, _ in net.named_parameters()]
    assert not np.array_equal(trained.layer("head").weight.value, net.layer("head").weight.value)


def test_train_in_bfloat16_follows_float32_and_writes_float32_weights(tmp_path, capsys):
    """--dtype bfloat16 trains with bfloat16 products (Network.autocast): the final loss is
    within 2% of float32 training's, and the written weights are float32 masters."""
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    finals = []
    for dtype in ("float32", "bfloat16"):
        out = tmp_path / f"{dtype}.lamina"
        assert main(["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--epochs", "3",
                     "--checkpoint-dir", str(tmp_path / dtype), "--quiet", "--dtype", dtype, "--out", str(out)]) == 0
        finals.append(float(capsys.readouterr().out.split("final loss ")[1].split()[0]))
        assert lm.load(out).precision == "float32"
    assert abs(finals[1] / finals[0] - 1) < 0.02, finals
    weights = lm.load(tmp_path / "bfloat16.lamina").layer("head").weight.value
    assert np.any(weights.view(np.uint32) & 0xFFFF)


@pytest.mark.skipif(not OPENCL_DEVICES, reason=NO_OPENCL)
def test_infer_and_train_on_opencl(tmp_path, capsys):
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


# ---------------------------------------------------------------- the command never destroys a model

def snapshot(path):
    st = path.stat()
    return path.read_bytes(), st.st_mode, st.st_mtime_ns


def train_args(tmp_path, *extra, data_file="d.npz"):
    return ["train", str(tmp_path / "m.lamina"), str(tmp_path / data_file), "--checkpoint-dir",
            str(tmp_path / "run"), "--quiet", *extra]


def test_training_writes_a_new_file_and_keeps_the_storage_type_and_umask(tmp_path):
    net = classifier(tmp_path / "m.lamina")
    lm.save(net, tmp_path / "m.lamina", half=True)
    data(tmp_path / "d.npz")
    before = snapshot(tmp_path / "m.lamina")
    old = os.umask(0o027)
    try:
        assert main(train_args(tmp_path, "--epochs", "2")) == 0
    finally:
        os.umask(old)
    assert snapshot(tmp_path / "m.lamina") == before
    out = tmp_path / "run" / "model.lamina"
    from lamina.io.model import _read
    _, tensors = _read(out)
    assert {t.dtype for t in tensors.values()} == {np.dtype(np.float16)}
    assert out.stat().st_mode & 0o777 == 0o640  # 0666 less the umask, not mkstemp's 0600
    assert main(train_args(tmp_path, "--out", str(tmp_path / "m.lamina"))) == 2


def test_failed_or_empty_runs_leave_the_model_untouched(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    before = snapshot(tmp_path / "m.lamina")
    np.savez(tmp_path / "empty.npz")
    x = np.ones((8, 4), np.float32)
    x[3, 2] = np.nan  # one bad sample in every batch of 8
    np.savez(tmp_path / "nan.npz", x=x, y=np.zeros(8, np.int32))
    assert main(train_args(tmp_path, data_file="empty.npz")) == 2
    assert "no array is named after an input" in capsys.readouterr().err
    assert main(train_args(tmp_path, "--batch-size", "8", data_file="nan.npz")) == 1
    err = capsys.readouterr().err
    assert "skipped 1 step(s)" in err and "no model was written" in err
    assert not (tmp_path / "run" / "model.lamina").exists()
    assert main(train_args(tmp_path, "--batch-size", "8", "--nonfinite", "raise", data_file="nan.npz")) == 1
    assert "the loss is nan" in capsys.readouterr().err
    assert snapshot(tmp_path / "m.lamina") == before
    # the checkpoint of the NaN run resumes: its parameters never became NaN
    ck = lm.load_checkpoint(tmp_path / "run" / "checkpoint.lamina")
    assert all(np.isfinite(p.value).all() for p in ck.net.parameters())


def test_a_nan_sample_skips_the_step_instead_of_poisoning_the_weights():
    net = lm.Network()
    x, y = net.input("x", 4), net.input("y", dtype="int32")
    logits = Linear(8, 3)(Linear(4, 8, activation="relu")(x))
    net.outputs(loss=SoftmaxCrossEntropy()(logits, y))
    opt = lm.optim.Adam(net, lr=0.1)
    before = [p.value.copy() for p in net.parameters()]
    bad = np.ones((4, 4), np.float32)
    bad[1, 0] = np.nan
    loss = net.train_step({"x": bad, "y": np.zeros(4, np.int32)}, opt)
    assert np.isnan(loss) and opt.last_step_skipped and opt.skipped_steps == 1 and opt.step_count == 0
    for p, b in zip(net.parameters(), before):
        np.testing.assert_array_equal(p.value, b)
    good = net.train_step({"x": np.ones((4, 4), np.float32), "y": np.zeros(4, np.int32)}, opt)
    assert np.isfinite(good) and not opt.last_step_skipped and opt.step_count == 1
    with pytest.raises(FloatingPointError, match="the loss is nan"):
        net.train_step({"x": bad, "y": np.zeros(4, np.int32)}, lm.optim.SGD(net, lr=0.1, nonfinite="raise"))


def test_an_infinite_gradient_with_a_finite_loss_is_not_applied():
    """x = 3e38 with zero weights: the outputs are the biases, the loss is finite, and the
    weight gradient 2 (y - t) x overflows float32; the step must not reach the weights."""
    net = lm.Network()
    x, t = net.input("x", 2), net.input("t", 2)
    fc = Linear(2, 2, name="fc")
    net.outputs(loss=lm.layers.SquareError()(fc(x), t))
    fc.weight.assign(np.zeros((2, 2)))
    feeds = {"x": np.array([[3e38, 0.0]], np.float32), "t": (fc.bias.value + 2).reshape(1, 2)}
    opt = lm.optim.SGD(net, lr=0.1)
    loss = net.train_step(feeds, opt)
    assert np.isfinite(loss) and opt.last_step_skipped and opt.skipped_steps == 1
    np.testing.assert_array_equal(fc.weight.value, np.zeros((2, 2)))
    with pytest.raises(FloatingPointError, match="the gradient of 'fc.weight' holds NaN or infinity"):
        net.train_step(feeds, lm.optim.SGD(net, lr=0.1, nonfinite="raise"))
    np.testing.assert_array_equal(fc.weight.value, np.zeros((2, 2)))


def test_resume_refuses_a_checkpoint_of_another_network(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    assert main(train_args(tmp_path, "--max-steps", "2")) == 0
    other = lm.Network()
    x, y = other.input("x", 4), other.input("y", dtype="int32")
    other.outputs(loss=SoftmaxCrossEntropy()(Linear(4, 3, name="head")(x), y))
    lm.save(other, tmp_path / "other.lamina")
    before = snapshot(tmp_path / "other.lamina")
    assert main(["train", str(tmp_path / "other.lamina"), str(tmp_path / "d.npz"), "--resume",
                 "--checkpoint-dir", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "is a checkpoint of another network" in err and err.count("\n") == 1
    assert snapshot(tmp_path / "other.lamina") == before


def test_checkpoint_every_and_a_log_flushed_per_step(tmp_path):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    from lamina import training
    net = lm.load(tmp_path / "m.lamina")
    opt = lm.optim.SGD(net, lr=0.01)
    seen = []

    class Watch:  # reads the log and the checkpoint while training runs, as `kill -9` would leave them
        def __init__(self, data):
            self.data = data

        def __len__(self):
            return len(self.data)

        def batch(self, index, rng):
            if (tmp_path / "run" / "log.jsonl").exists():
                lines = (tmp_path / "run" / "log.jsonl").read_text().splitlines()
                ck = tmp_path / "run" / "checkpoint.lamina"
                seen.append((len(lines), lm.load_checkpoint(ck).step_count if ck.exists() else None))
            return self.data.batch(index, rng)
    training.fit(net, Watch(training.ArrayData(net, tmp_path / "d.npz")), opt, epochs=1, batch_size=16,
                 folder=tmp_path / "run", progress=False, checkpoint_every=2)
    # before step k (0-based) runs, k log lines are on disk and the checkpoint is at an even step
    assert [n for n, _ in seen] == list(range(6))
    assert [c for _, c in seen] == [None, None, 2, 2, 4, 4]


def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz")
    np.save(tmp_path / "a.npy", np.zeros(3))
    (tmp_path / "text.npz").write_text("not a zip")
    (tmp_path / "file").write_text("")
    x = np.zeros((2, 4), np.float32)
    np.savez(tmp_path / "big_ids.npz", x=x, y=np.array([0, 2 ** 32 + 1], np.int64))
    np.savez(tmp_path / "bad_labels.npz", x=x, y=np.array([0, 7], np.int32))
    m, d = str(tmp_path / "m.lamina"), str(tmp_path / "d.npz")
    cases = [
        (["train", m, d, "--batch-size", "0"], "--batch-size: expected a positive integer"),
        (["train", m, d, "--lr", "-1"], "--lr: expected a finite positive number"),
        (["train", m, d, "--lr", "nan"], "--lr: expected a finite positive number"),
        (["train", m, d, "--epochs", "0"], "--epochs: expected a positive integer"),
        (["infer", m, d, "--tokens", "-5"], "--tokens: expected a positive integer"),
        (["train", m, str(tmp_path / "a.npy"), "--checkpoint-dir", str(tmp_path / "r")], "found a single array"),
        (["train", m, str(tmp_path / "text.npz"), "--checkpoint-dir", str(tmp_path / "r")], "cannot read the file"),
        (["infer", m, d, "-o", str(tmp_path / "missing" / "out.npz")], "does not exist"),
        (["train", m, d, "--checkpoint-dir", str(tmp_path / "file")], "is a file, expected a folder"),
        (["infer", m, str(tmp_path / "big_ids.npz")], "must fit int32, found 4294967297"),
        (["train", m, str(tmp_path / "bad_labels.npz"), "--checkpoint-dir", str(tmp_path / "r"), "--quiet"],
         "labels (input 1) must lie in [0, 3), found 7"),
    ]
    for argv, expected in cases:
        try:
            code = main(argv)
        except SystemExit as e:  # argparse's own checks
            code = e.code
        assert code == 2, argv
        err = capsys.readouterr().err
        assert expected in err and err.count("\n") == 1, (argv, err)
    assert not list((tmp_path).glob("**/*.tmp*"))
    env = dict(os.environ, LAMINA_THREADS="abc")
    proc = subprocess.run([sys.executable, "-m", "lamina.cli", "devices"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "lamina devices: LAMINA_THREADS: expected a positive integer, found 'abc'\n"
    env = dict(os.environ, LAMINA_BLAS="atlas")
    proc = subprocess.run([sys.executable, "-m", "lamina.cli", "devices"], env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr == "lamina devices: LAMINA_BLAS: expected one of mkl, openblas, found 'atlas'\n"


def test_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    out = capsys.readouterr().out
    assert "(default: 0.001)" in out and "(default: 32)" in out and "(default: skip)" in out


def test_inspect_lists_a_shared_weight_once(tmp_path, capsys):
    net = lm.Network()
    x = net.input("x", 4)
    a, b = Linear(4, 4, name="a"), Linear(4, 4, name="b")
    b.tie("weight", a.weight)
    net.outputs(y=b(a(x)))
    lm.save(net, tmp_path / "tied.lamina")
    assert main(["inspect", str(tmp_path / "tied.lamina")]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[3:] for line in out.splitlines() if line.startswith(("a ", "b "))}
    assert rows == {"a": ["20"], "b": ["4", "(+", "a.weight)"]}, out
    assert "24 parameters" in out


def start_training(tmp_path, *extra):
    """A `lamina train` process on 4000 samples for many epochs, once its log has a few dozen
    steps."""
    classifier(tmp_path / "m.lamina")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4000, 4)).astype(np.float32)
    np.savez(tmp_path / "big.npz", x=x, y=(x[:, 0] > 0).astype(np.int32))
    run = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "lamina.cli", "train", str(tmp_path / "m.lamina"),
                             str(tmp_path / "big.npz"), "--epochs", "1000", "--batch-size", "8",
                             "--checkpoint-dir", str(run), "--quiet", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not (run / "log.jsonl").exists() or (run / "log.jsonl").stat().st_size < 2000:
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    return proc, run


def test_a_killed_runs_temporaries_and_extra_log_lines_are_cleaned_up_on_resume(tmp_path):
    """kill -9 after the last checkpoint: the log holds steps the checkpoint does not, and a
    save cut short leaves its temporary file. The resumed run removes the temporary and logs
    each step once: its log reads as one run of consecutive steps."""
    import shutil
    proc, run = start_training(tmp_path, "--checkpoint-every", "50")
    # the kill must come after steps past the last checkpoint (not at one): keep a checkpoint as
    # it was written, kill once the log is 20 steps past it, and leave that checkpoint as the last
    while not (run / "checkpoint.lamina").exists():
        time.sleep(0.01)
    shutil.copy(run / "checkpoint.lamina", tmp_path / "kept.lamina")
    kept = lm.load_checkpoint(tmp_path / "kept.lamina").step_count
    while len((run / "log.jsonl").read_text().splitlines()) < kept + 20:
        time.sleep(0.01)
    proc.kill()
    proc.communicate(timeout=60)
    shutil.copy(tmp_path / "kept.lamina", run / "checkpoint.lamina")
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = [run / f".tmp-{dead.stdout.strip()}-abc123.lamina", run / ".tmp-old9xyz.lamina"]
    for path in stale:
        path.write_bytes(b"half a model")
    os.utime(stale[1], (time.time() - 7200, time.time() - 7200))
    mine = run / f".tmp-{os.getpid()}-live.lamina"  # a writer still running: kept
    mine.write_bytes(b"in progress")
    ck = lm.load_checkpoint(run / "checkpoint.lamina")
    logged = len((run / "log.jsonl").read_text().splitlines())
    assert logged > ck.step_count  # the kill came after steps the checkpoint does not hold
    resumed = ck.step_count + 30
    assert main(["train", str(tmp_path / "m.lamina"), str(tmp_path / "big.npz"), "--epochs", "1000",
                 "--batch-size", "8", "--checkpoint-dir", str(run), "--quiet", "--resume",
                 "--max-steps", str(resumed)]) == 0
    assert not any(p.exists() for p in stale) and mine.exists()
    import json
    steps = [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, resumed + 1))


def test_infer_in_bfloat16_scores_within_the_precision(capsys):
    """--dtype bfloat16 multiplies in bfloat16: the same text scores within 1% of float32."""
    text = ("import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
            "        if name.endswith('.py'):\n            print(os.path.join(argv[1], name))\n    return 0\n")
    scores = []
    for dtype in ("float32", "bfloat16"):
        assert main(["infer", "python_lm", "--text", text, "--tokens", "1", "--dtype", dtype]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("perplexity of the input"))
        scores.append(float(line.rsplit(":", 1)[1]))
    assert abs(scores[1] / scores[0] - 1) < 0.01, scores


def test_quantize_writes_an_int8_model_that_scores_within_two_percent(tmp_path, capsys):
    """lamina quantize stores int8 weights; infer on it (and infer --dtype int8 on the float32
    model) scores a text within 2% of float32."""
    text = ("import os\nimport sys\n\n\ndef main(argv):\n    for name in sorted(os.listdir(argv[1])):\n"
            "        if name.endswith('.py'):\n            print(os.path.join(argv[1], name))\n    return 0\n")
    out = tmp_path / "lm8.lamina"
    assert main(["quantize", "python_lm", "-o", str(out)]) == 0
    assert "weights stored in int8" in capsys.readouterr().out
    assert main(["inspect", str(out)]) == 0
    assert "parameters stored as float32, int8" in capsys.readouterr().out
    assert lm.load(out).precision == "int8"
    scores = []
    for args in (["python_lm"], [str(out)], ["python_lm", "--dtype", "int8"]):
        assert main(["infer", *args, "--text", text, "--tokens", "1"]) == 0
        line = next(s for s in capsys.readouterr().out.splitlines() if s.startswith("perplexity of the input"))
        scores.append(float(line.rsplit(":", 1)[1]))
    assert scores[1] == scores[2] and abs(scores[1] / scores[0] - 1) < 0.02, scores
    assert main(["quantize", "python_lm", "-o", str(tmp_path / "x.onnx")]) == 2
    assert "writes a lamina model file" in capsys.readouterr().err
