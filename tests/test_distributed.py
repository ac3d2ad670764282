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
    results = [dict(np.load(out / f"rank{r}.npz")) for r in range(ranks)]
    for r in results:
        r.pop("losses"), r.pop("dense_rows_steps")
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


