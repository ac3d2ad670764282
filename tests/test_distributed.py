"""Data-parallel training over MPI, run for real: `mpiexec -n 2` and `-n 3` from the mpich wheel
(installed by `make test`) start tests/distributed_worker.py or `lamina train`; their parameters
must equal one process's over the same global batches, and be bit-identical on every rank.
Faults (a killed, raising or hanging rank, Ctrl-C) must end the job promptly and cleanly."""
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import lamina as lm
from lamina.cli import main
from lamina.distributed.reducer import merge_rows
from lamina.selection import Selection
from lamina.sequence import Sequences

from distributed_cases import CASES, optimizer
from test_cli import classifier, data

HERE = Path(__file__).resolve().parent
WORKER = HERE / "distributed_worker.py"
MPIEXEC = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")


def mpi_environment():
    """The environment an MPI job needs on a machine with loopback only, run as root (CI):
    MPICH's hydra starts ranks by fork, and Open MPI is allowed to run as root, oversubscribed,
    without ssh. One kernel thread per rank: two ranks share this machine's two cores."""
    env = dict(os.environ)
    env.update(HYDRA_LAUNCHER="fork", HYDRA_IFACE="lo",
               OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_plm="isolated",
               OMPI_MCA_rmaps_base_oversubscribe="true", OMPI_MCA_btl_vader_single_copy_mechanism="none",
               LAMINA_THREADS="1", PYTHONPATH=str(HERE))
    return env


def mpiexec(n, args, timeout=240, **kw):
    assert MPIEXEC, "no mpiexec: `make test` installs the mpich wheel (pip install 'lamina[mpi]')"
    return subprocess.run([MPIEXEC, "-n", str(n), *args], env=mpi_environment(), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL, **kw)


def joined(parts):
    """One batch of the samples of several feeds, in order (what one process would see)."""
    out = {}
    for name, first in parts[0].items():
        values = [p[name] for p in parts]
        if isinstance(first, Sequences):
            out[name] = Sequences.from_list([s.values[s.starts[i]:s.starts[i + 1]] for s in values
                                             for i in range(s.num_sequences)], first.values.dtype)
        elif isinstance(first, Selection):
            lists = [s.columns[s.starts(0)[i]:s.starts(0)[i + 1]] for s in values for i in range(s.num_rows())]
            logq = None if first.logq is None else [s.logq[s.starts(0)[i]:s.starts(0)[i + 1]]
                                                    for s in values for i in range(s.num_rows())]
            out[name] = Selection.from_lists(lists, logq)
        else:
            out[name] = np.concatenate(values)
    return out


def single_process(case_name, kind, steps, ranks):
    """The parameters after `steps` steps in one process over the global batches the ranks
    shared out, each rank's shard drawn as that rank drew it."""
    case = CASES[case_name]()
    lm.manual_seed(100)  # rank 0's initialisation
    net = case.network()
    opt = optimizer(kind, net)
    for step in range(steps):
        shards = np.array_split(case.global_batch(step), ranks)
        net.train_step(joined([case.feeds(net, s, step, r) for r, s in enumerate(shards) if len(s)]), opt)
    return {name: p.value for name, p in net.named_parameters()}


def digest(arrays):
    h = hashlib.sha256()
    for name in sorted(arrays):
        h.update(name.encode() + np.ascontiguousarray(arrays[name]).tobytes())
    return h.hexdigest()


def check_ranks_match(out, ranks, reference, rtol=1e-5):
    results = [{k: v for k, v in np.load(out / f"rank{r}.npz").items() if k in reference} for r in range(ranks)]
    assert len({digest(r) for r in results}) == 1, "the ranks' parameters differ"
    for name, want in reference.items():
        got = results[0][name]
        scale = np.abs(want).max()
        assert np.abs(got - want).max() <= rtol * scale, (name, np.abs(got - want).max() / scale)


@pytest.mark.parametrize("ranks", [2, 3])
@pytest.mark.parametrize("kind", ["sgd", "adam", "adam-clip"])
def test_ranks_train_as_one_process_over_the_global_batch(tmp_path, ranks, kind):
    """Rank-dependent initial values (the broadcast must fix them); step 4's global batch holds
    2 samples, so with 3 ranks one joins that step with nothing (net.idle_step)."""
    proc = mpiexec(ranks, [sys.executable, str(WORKER), "classifier", kind, "10", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    check_ranks_match(tmp_path, ranks, single_process("classifier", kind, 10, ranks))


@pytest.mark.parametrize("kind", ["sgd-rows", "adam-fine"])
def test_language_model_sparse_gradients(tmp_path, kind):
    """Embedding and selective-layer gradients travel as rows; plain SGD updates only the rows,
    Adam makes them dense: both must equal one process."""
    proc = mpiexec(3, [sys.executable, str(WORKER), "language", kind, "10", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    check_ranks_match(tmp_path, 3, single_process("language", kind, 10, 3))


@pytest.mark.parametrize("kind", ["sgd-rows", "adam-lazy"])
def test_sparse_gradients_that_fill_the_table_are_summed_densely(tmp_path, kind):
    proc = mpiexec(2, [sys.executable, str(WORKER), "lookup", kind, "10", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    check_ranks_match(tmp_path, 2, single_process("lookup", kind, 10, 2))
    stats = np.load(tmp_path / "rank0.npz")
    assert stats["dense_rows_steps"] >= 8  # every step after the first went dense
    # rows no id uses never moved (a dense sum without the marks would have updated them)
    start = CASES["lookup"]()
    lm.manual_seed(100)
    first = start.network().layer("table").weight.value
    np.testing.assert_array_equal(stats["table.weight"][35:], first[35:])


@pytest.mark.parametrize("kind", ["sgd-rows", "adam"])
def test_a_dense_gradient_on_one_rank_and_rows_on_another(tmp_path, kind):
    proc = mpiexec(2, [sys.executable, str(WORKER), "mixed", kind, "10", str(tmp_path)], timeout=120)
    assert proc.returncode == 0, proc.stderr
    check_ranks_match(tmp_path, 2, single_process("mixed", kind, 10, 2))


def test_denoiser(tmp_path):
    """Global batches of 4 volumes over 3 ranks: shards of 2, 1 and 1 weigh every volume alike."""
    proc = mpiexec(3, [sys.executable, str(WORKER), "denoiser", "adam", "10", str(tmp_path)])
    assert proc.returncode == 0, proc.stderr
    check_ranks_match(tmp_path, 3, single_process("denoiser", "adam", 10, 3))


@pytest.mark.parametrize("fail", ["kill", "raise", "hang"])
def test_a_failing_rank_ends_the_job(tmp_path, fail):
    start = time.monotonic()
    proc = mpiexec(2, [sys.executable, str(WORKER), "classifier", "adam", "10", str(tmp_path), "--fail", fail,
                       "--timeout", "5"], timeout=120)
    assert proc.returncode != 0
    assert time.monotonic() - start < 60
    if fail == "raise":
        assert "rank 1/2: stopping the job after an error" in proc.stderr
        assert "rank 1 fails on purpose at step 3" in proc.stderr
    if fail == "hang":
        assert "rank 0/2: waited 5 s for" in proc.stderr and "another rank stopped or hangs" in proc.stderr
    assert not list(tmp_path.glob("rank*.npz"))


def train(tmp_path, ranks, *extra):
    args = ["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--batch-size", "12",
            "--epochs", "2", "--optimizer", "adam", "--lr", "0.01", "--quiet", *extra]
    if ranks == 0:
        assert main(args) == 0
        return None
    return mpiexec(ranks, [sys.executable, "-m", "lamina.cli", *args])


def test_lamina_train_resumes_with_another_rank_count(tmp_path):
    """2 ranks for 5 steps, then 3 ranks resume from the checkpoint for 5 more: the same model
    as one process for 10 steps, and one log of 10 steps written by rank 0."""
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz", n=90)
    first = train(tmp_path, 2, "--checkpoint-dir", str(tmp_path / "run"), "--max-steps", "5",
                  "--checkpoint-every", "5")
    assert first.returncode == 0, first.stderr
    assert "data-parallel over 2 ranks" in first.stdout and first.stdout.count("training ") == 1
    second = train(tmp_path, 3, "--checkpoint-dir", str(tmp_path / "run"), "--max-steps", "10", "--resume")
    assert second.returncode == 0, second.stderr
    assert "resuming from" in second.stdout
    train(tmp_path, 0, "--checkpoint-dir", str(tmp_path / "one"), "--max-steps", "10")
    got, want = lm.load(tmp_path / "run" / "model.lamina"), lm.load(tmp_path / "one" / "model.lamina")
    for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
        np.testing.assert_allclose(p.value, q.value, rtol=1e-5, atol=1e-6 * np.abs(q.value).max(), err_msg=name)
    logged = [line for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert len(logged) == 10
    import json
    losses = [json.loads(line)["loss"] for line in logged]
    one = [json.loads(line)["loss"] for line in (tmp_path / "one" / "log.jsonl").read_text().splitlines()]
    np.testing.assert_allclose(losses, one, rtol=1e-5)


def test_ctrl_c_on_mpiexec_leaves_a_valid_checkpoint(tmp_path):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d.npz", n=4800)
    run = tmp_path / "run"
    args = ["train", str(tmp_path / "m.lamina"), str(tmp_path / "d.npz"), "--batch-size", "4", "--epochs", "50",
            "--checkpoint-dir", str(run), "--quiet"]
    proc = subprocess.Popen([MPIEXEC, "-n", "2", sys.executable, "-m", "lamina.cli", *args],
                            env=mpi_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    log = run / "log.jsonl"
    deadline = time.monotonic() + 60
    while (not log.exists() or log.stat().st_size < 2000) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "interrupted: checkpoint written" in out + err
    ck = lm.load_checkpoint(run / "checkpoint.lamina")
    steps = len(log.read_text().splitlines())
    assert ck.step_count == steps and ck.fields["batch"] == steps % 1200
    assert 0 < steps < 1200 * 50


def test_merge_rows_adds_equal_rows_in_rank_order():
    rows = np.array([5, 2, 5, 9, 2], np.int32)
    values = np.arange(10, dtype=np.float32).reshape(5, 2)
    merged, summed = merge_rows(rows, values)
    np.testing.assert_array_equal(merged, [2, 5, 9])
    np.testing.assert_array_equal(summed, [[2 + 8, 3 + 9], [0 + 4, 1 + 5], [6, 7]])


def test_the_sampler_shards_one_shuffle():
    """Every rank draws the same (seed, epoch) permutation; the shards of 1, 2 or 3 ranks join
    into the same global batches (so a checkpoint resumes with any rank count)."""
    from lamina.distributed import ShardedSampler

    class Rank:
        def __init__(self, rank, size):
            self.rank, self.size = rank, size
    whole = ShardedSampler(50, 16, None, seed=3)
    assert len(whole) == 4
    for epoch in range(2):
        order = np.random.default_rng([3, epoch]).permutation(50)
        for b in range(4):
            np.testing.assert_array_equal(whole.indices(epoch, b), order[16 * b:16 * b + 16])
            for size in (2, 3):
                parts = [ShardedSampler(50, 16, Rank(r, size), seed=3).indices(epoch, b) for r in range(size)]
                np.testing.assert_array_equal(np.concatenate(parts), order[16 * b:16 * b + 16])
                assert max(map(len, parts)) - min(map(len, parts)) <= 1




@pytest.mark.parametrize("case_name", ["classifier", "language"])
def test_the_ranks_hand_the_optimizer_the_sum_of_their_gradients(tmp_path, case_name):
    """The gradients each rank's optimizer gets in the first step are the whole global batch's,
    as one process computes them (dense, and the language model's rows): a reducer that
    averaged over the ranks, or dropped a rank's rows, differs by a factor or by rows. Adam's
    steps cannot show a scale; the gradients themselves do."""
    proc = mpiexec(2, [sys.executable, str(WORKER), case_name, "sgd", "1", str(tmp_path), "--record-grads"])
    assert proc.returncode == 0, proc.stderr
    case = CASES[case_name]()
    lm.manual_seed(100)
    net = case.network()
    shards = np.array_split(case.global_batch(0), 2)
    net.forward(joined([case.feeds(net, s, 0, r) for r, s in enumerate(shards)]))
    net.backward()
    ranks = [dict(np.load(tmp_path / f"rank{r}.npz")) for r in range(2)]
    recorded = [k for k in ranks[0] if k.startswith("grad/")]
    assert len(recorded) == len(net.parameters())
    for name, p in net.named_parameters():
        want = np.array(lm.parameter.host(p.grad))
        if p.grad_rows is not None:
            dense = np.zeros_like(want)
            dense[p.grad_rows] = want[p.grad_rows]
            want = dense
        for r in ranks:
            got = r[f"grad/{name}"]
            scale = np.abs(want).max()
            assert scale > 0 and np.abs(got - want).max() <= 1e-5 * scale, (name, np.abs(got - want).max() / scale)


def test_a_rank_waiting_for_a_late_one_does_not_hold_a_core(tmp_path):
    """Rank 1 pauses 3 s in a step: rank 0 waits for its gradients with the CPU mostly idle
    (it polled without pause before, a whole core for as long as it waited)."""
    proc = mpiexec(2, [sys.executable, str(WORKER), "classifier", "adam", "6", str(tmp_path), "--fail", "late"])
    assert proc.returncode == 0, proc.stderr
    rank0 = np.load(tmp_path / "rank0.npz")
    assert rank0["wait_wall"] > 2.5
    assert rank0["wait_cpu"] < 0.3 * rank0["wait_wall"], (float(rank0["wait_cpu"]), float(rank0["wait_wall"]))
    check_ranks_match(tmp_path, 2, single_process("classifier", "adam", 6, 2))


def mpmd(args_per_rank, timeout=120):
    """One rank per argument list (MPI's multiple-program form: mpiexec -n 1 A : -n 1 B)."""
    command = [MPIEXEC]
    for i, args in enumerate(args_per_rank):
        command += ([":"] if i else []) + ["-n", "1", *args]
    return subprocess.run(command, env=mpi_environment(), capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)


def lamina_train(model, data_file, run, *extra):
    return [sys.executable, "-m", "lamina.cli", "train", str(model), str(data_file), "--batch-size", "12",
            "--epochs", "2", "--quiet", "--checkpoint-dir", str(run), *extra]


def test_ranks_whose_graphs_differ_are_refused(tmp_path):
    """The same parameters (names, shapes), but a tanh on one rank and a ReLU on the other:
    the job stops before training, naming the layer."""
    from lamina.layers import Linear, SoftmaxCrossEntropy
    classifier(tmp_path / "tanh.lamina")
    tanh = lm.load(tmp_path / "tanh.lamina")
    net = lm.Network()
    x, y = net.input("x", 4), net.input("y", dtype="int32")
    logits = Linear(8, 3, name="head")(Linear(4, 8, activation="relu", name="hidden")(x))
    net.outputs(loss=SoftmaxCrossEntropy(name="xent")(logits, y), logits=logits)
    for name, p in net.named_parameters():
        p.assign(dict(tanh.named_parameters())[name].value)
    lm.save(net, tmp_path / "relu.lamina")
    data(tmp_path / "d.npz", n=48)
    start = time.monotonic()
    proc = mpmd([lamina_train(tmp_path / "tanh.lamina", tmp_path / "d.npz", tmp_path / "run"),
                 lamina_train(tmp_path / "relu.lamina", tmp_path / "d.npz", tmp_path / "run")])
    assert proc.returncode != 0 and time.monotonic() - start < 60
    assert "rank 1/2: this rank's network differs from rank 0's graph:" in proc.stderr, proc.stderr
    assert "'hidden'" in proc.stderr and "relu" in proc.stderr and "tanh" in proc.stderr
    assert not (tmp_path / "run" / "model.lamina").exists()


def test_ranks_given_data_sets_of_different_sizes_are_refused(tmp_path):
    classifier(tmp_path / "m.lamina")
    data(tmp_path / "d96.npz", n=96)
    data(tmp_path / "d48.npz", n=48)
    start = time.monotonic()
    proc = mpmd([lamina_train(tmp_path / "m.lamina", tmp_path / "d96.npz", tmp_path / "run"),
                 lamina_train(tmp_path / "m.lamina", tmp_path / "d48.npz", tmp_path / "run")])
    assert proc.returncode == 2 and time.monotonic() - start < 60
    assert ("lamina train: the ranks differ in the number of samples (rank 0: 96, rank 1: 48); every rank must "
            "see the same") in proc.stderr, proc.stderr


def source_files(tmp_path):
    """Python source for the language model: a few modules of the standard library."""
    import json
    files = []
    for module in ("decoder.py", "encoder.py", "__init__.py"):
        target = tmp_path / f"json_{module}"
        target.write_text((Path(json.__file__).parent / module).read_text())
        files.append(str(target))
    return files


def train_language(tmp_path, ranks, run, steps, *extra):
    args = ["train", str(HERE.parent / "models" / "python_lm" / "model.lamina"), *source_files(tmp_path),
            "--batch-size", "12", "--max-steps", str(steps), "--checkpoint-dir", str(run), "--quiet",
            "--lr", "0.003", *extra]
    if ranks == 0:
        assert main(args) == 0
        return
    proc = mpiexec(ranks, [sys.executable, "-m", "lamina.cli", *args])
    assert proc.returncode == 0, proc.stderr


def test_the_language_model_resumes_exactly_with_another_rank_count(tmp_path):
    """2 ranks train 3 steps and checkpoint; 3 ranks resume for 3 more, and so does one
    process from the same checkpoint: both end where one process training 6 steps ends (the
    sampled negatives are drawn per sample, keyed by its place in the global batch, not per
    rank)."""
    import json
    train_language(tmp_path, 2, tmp_path / "two", 3, "--checkpoint-every", "3")
    shutil.copytree(tmp_path / "two", tmp_path / "one_after_two")
    train_language(tmp_path, 3, tmp_path / "two", 6, "--resume")
    train_language(tmp_path, 0, tmp_path / "one_after_two", 6, "--resume")
    train_language(tmp_path, 0, tmp_path / "one", 6)
    # the checkpoints hold float32 parameters (the models are written as float16, as the input)
    final = lambda run: lm.load_checkpoint(tmp_path / run / "checkpoint.lamina").net
    want = final("one")
    losses = lambda run: [json.loads(line)["loss"] for line in (run / "log.jsonl").read_text().splitlines()]
    for run in ("two", "one_after_two"):
        got = final(run)
        for (name, p), (_, q) in zip(got.named_parameters(), want.named_parameters()):
            # the ranks' gradient sums round in another order, so nearly every element agrees to
            # the rounding; Adam's normalised step turns the rounding of a near-zero gradient
            # into up to lr (0.003) per step, so a few elements may differ by up to that over
            # the 6 steps (a wrong resume moves most elements by far more than the rounding)
            diff = np.abs(p.value - q.value)
            assert np.quantile(diff, 0.999) <= 1e-5 * np.abs(q.value).max(), (run, name)
            assert diff.max() <= 6 * 0.003, (run, name)
        np.testing.assert_allclose(losses(tmp_path / run), losses(tmp_path / "one"), rtol=1e-5)
